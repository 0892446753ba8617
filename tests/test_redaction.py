import pytest

from kvconn.redaction import MASK, redact_options, redact_url


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("redis://:secret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("rediss://alice:p%40ss@host/1", "rediss://alice:***@host/1"),
        (
            "cannot reach redis://bob:hunter2@h:1 (refused)",
            "cannot reach redis://bob:***@h:1 (refused)",
        ),
        ("unix://u:pw@/run/redis.sock?db=2", "unix://u:***@/run/redis.sock?db=2"),
        ("redis://alice@host/1", "redis://alice@host/1"),  # a user name alone is no secret
        ("redis://host:6379/0", "redis://host:6379/0"),  # a port is not a password
    ],
)
def test_url_passwords_are_masked_wherever_they_appear(text, shown):
    assert redact_url(text) == shown


def test_options_named_as_secrets_are_masked_and_urls_in_others_cleaned():
    options = {
        "url": "redis://:s3cr3t@h:1/0",
        "password": "s3cr3t",
        "ApiKey": 12345,
        "nodes": ["redis://u:s3cr3t@a:1", "redis://b:2"],
        "timeout_s": 1.5,
        "username": "alice",
        "tls": {"key_password": "x"},
    }
    shown = redact_options(options)
    assert "s3cr3t" not in repr(shown)
    assert shown["password"] == MASK
    assert shown["ApiKey"] == MASK
    assert shown["tls"] == {"key_password": MASK}
    assert shown["timeout_s"] == 1.5 and shown["username"] == "alice"
    assert shown["nodes"] == ["redis://u:***@a:1", "redis://b:2"]
    assert options["password"] == "s3cr3t"  # the original is untouched
