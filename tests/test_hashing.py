import hashlib

import pytest

from kvconn.errors import ConfigError, InvalidKeyError
from kvconn.hashing import (
    DIGEST_SIZE,
    ReuseScope,
    adopt_hash,
    adopt_hashes,
    block_hashes,
    hash_block,
)


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(95)), 32)) == 2
    assert block_hashes(list(range(31)), 32) == []


def test_hashes_are_16_byte_digests_that_chain():
    hashes = block_hashes(list(range(64)), 32)
    assert all(len(h) == 16 for h in hashes)
    assert hashes[1] == hash_block(hashes[0], list(range(32, 64)))


def test_a_block_hash_names_its_whole_prefix():
    a = block_hashes([1] * 32 + [2] * 32, 32)
    b = block_hashes([9] * 32 + [2] * 32, 32)
    assert a[1] != b[1]  # same tokens in block 1, different prefix


def test_hashes_are_stable_across_processes_and_machines():
    # A fixed vector: Python's hash() randomisation or a platform change would break it.
    assert block_hashes(list(range(32)), 32)[0].hex() == block_hashes(range(32), 32)[0].hex()
    assert block_hashes([0] * 32, 32)[0].hex() == "bf2ec35c2e1a81699046bd1e98fd920b"


def test_different_salts_never_share_blocks():
    tokens = list(range(128))
    plain = block_hashes(tokens, 32)
    salted = block_hashes(tokens, 32, ReuseScope(cache_salt="tenant-a"))
    other = block_hashes(tokens, 32, ReuseScope(cache_salt="tenant-b"))
    assert not set(plain) & set(salted)
    assert not set(salted) & set(other)


def test_lora_and_multimodal_inputs_change_the_hashes():
    tokens = list(range(64))
    base = block_hashes(tokens, 32)
    assert block_hashes(tokens, 32, ReuseScope(lora_id="a"))[0] != base[0]
    assert block_hashes(tokens, 32, ReuseScope(mm_digests=(b"img",)))[0] != base[0]
    extra = block_hashes(tokens, 32, extras=[b"", b"image-digest"])
    assert extra[0] == base[0] and extra[1] != base[1]


def test_scope_fields_cannot_be_confused_by_concatenation():
    assert (
        ReuseScope(cache_salt="ab", lora_id="c").seed()
        != ReuseScope(cache_salt="a", lora_id="bc").seed()
    )


VLLM = [bytes([i]) * 32 for i in range(3)]  # vLLM's 32-byte block hashes
SGLANG = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]  # 64-char hex strings


def test_adopted_engine_hashes_have_the_kvconn_digest_size_and_are_deterministic():
    adopted = adopt_hashes("vllm:sha256", VLLM)
    assert all(len(h) == DIGEST_SIZE for h in adopted)
    assert adopted == adopt_hashes("vllm:sha256", VLLM)
    assert adopted[1] == adopt_hash("vllm:sha256", VLLM[1])
    assert adopt_hash("sglang:sha256", SGLANG[0]).hex() == (
        "db4e94a510728dc010d03c1b3ff8a826"
    )  # a fixed vector: every process and release must agree


def test_engine_hashes_that_share_a_prefix_are_not_truncated_into_one_address():
    a, b = b"\x07" * 16 + b"\x00" * 16, b"\x07" * 16 + b"\x01" * 16
    assert adopt_hash("vllm:sha256", a) != adopt_hash("vllm:sha256", b)
    assert adopt_hash("vllm:sha256", a) != a[:DIGEST_SIZE]


def test_adopted_hashes_never_meet_kvconn_chain_or_another_scheme():
    own = block_hashes(list(range(32)), 32)[0]
    assert adopt_hash("vllm:sha256", own) != own  # a 16-byte engine hash stays apart
    assert adopt_hash("vllm:sha256", VLLM[0]) != adopt_hash("trtllm:sha256", VLLM[0])
    # the same text as bytes and as str (hex strings) are different engine hashes
    assert adopt_hash("x", SGLANG[0]) != adopt_hash("x", SGLANG[0].encode())


@pytest.mark.parametrize(
    ("scheme", "hashes", "error", "message"),
    [
        ("kvconn", VLLM, ConfigError, "reserved"),
        ("VLLM", VLLM, ConfigError, "must be 1-64 characters"),
        ("vllm/sha", VLLM, ConfigError, "must be 1-64 characters"),
        ("vllm", [b"short"], InvalidKeyError, "hash 0 has 5 bytes; at least 8"),
        ("vllm", [VLLM[0], 12345], InvalidKeyError, "hash 1 must be bytes or str, got int"),
        ("vllm", VLLM[0], InvalidKeyError, "not a single hash"),
    ],
)
def test_bad_schemes_and_engine_hashes_are_refused_naming_the_problem(
    scheme, hashes, error, message
):
    with pytest.raises(error, match=message):
        adopt_hashes(scheme, hashes)
