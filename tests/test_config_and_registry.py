import subprocess
import sys

import pytest

from kvconn.backend import Backend
from kvconn.config import ConnectorConfig, parse_literal
from kvconn.errors import BackendDependencyMissing, BackendNotFound, ConfigError
from kvconn.plan import WriterPolicy
from kvconn.registry import describe_backends, installed_backends, load_backend


def test_a_config_is_built_from_a_plain_dict():
    cfg = ConnectorConfig.from_dict(
        {
            "model": "m@r1",
            "backend": "lmdb",
            "options": {"path": "/tmp/x"},
            "writer_policy": "first",
        }
    )
    assert cfg.writer_policy is WriterPolicy.FIRST and cfg.options == {"path": "/tmp/x"}


def test_unknown_configuration_keys_are_errors_not_ignored():
    with pytest.raises(ConfigError, match="unknown configuration key\\(s\\): writer_polcy"):
        ConnectorConfig.from_dict({"model": "m", "writer_polcy": "first"})


def test_the_model_revision_is_required():
    with pytest.raises(ConfigError, match="needs 'model'"):
        ConnectorConfig.from_dict({"backend": "lmdb"})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("staging_bytes", 0, "staging_bytes"),
        ("retry_interval_s", -1, "retry_interval_s"),
        ("idle_wait_s", -0.001, "idle_wait_s must be a number of seconds"),
        ("idle_wait_s", "5ms", "idle_wait_s must be a number of seconds"),
        ("lookup_inline", "yes", "lookup_inline must be true or false, got 'yes'"),
        ("writer_policy", "rank0", "writer_policy"),
        ("options", "path=/x", "options must be a table"),
        ("backend", "", "backend must be"),
        ("transfer_cpus", "cores 6-7", "transfer_cpus: 'cores 6-7' is not a CPU number or range"),
        ("transfer_cpus", "3-1", "transfer_cpus: the range '3-1' runs backwards"),
        ("transfer_cpus", " , ", "transfer_cpus names no CPU"),
        ("transfer_cpus", "0-99999999", "CPU 99999999 is beyond any machine's"),
        ("transfer_cpus", ["6", "7"], "transfer_cpus must be 'auto', 'inherit' or a CPU list"),
    ],
)
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_dict({"model": "m", field: value})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("1.5", r"staging_bytes: '1.5' is 1.5 bytes, not a whole number of bytes"),
        ("0.3KiB", r"'0.3KiB' is 307.2 bytes, not a whole number"),
        ("1.0000000001GiB", "not a whole number of bytes"),
    ],
)
def test_a_size_that_is_a_fraction_of_a_byte_is_refused_not_rounded(given, message):
    """Issue 15: ``"1.5"`` was accepted as 1 byte."""
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_dict({"model": "m", "staging_bytes": given})


@pytest.mark.parametrize(
    ("given", "size"), [("1.5GiB", 3 * 2**29), ("0.5KiB", 512), ("2.0", 2), ("256MiB", 2**28)]
)
def test_a_size_with_a_fraction_that_comes_to_whole_bytes_is_accepted(given, size):
    assert ConnectorConfig.from_dict({"model": "m", "staging_bytes": given}).staging_bytes == size


@pytest.mark.parametrize(
    ("field", "value"),
    [("model", "m\x00"), ("model", "org/model\nrev"), ("namespace", "ns\t"), ("model", "m\u00a0")],
)
def test_names_that_become_keys_refuse_control_and_invisible_characters(field, value):
    """Escaped, they made keys (``m%00``) that no correctly configured process computes."""
    config = {"model": "m", field: value}
    with pytest.raises(ConfigError, match=f"{field} .* contains the control or invisible"):
        ConnectorConfig.from_dict(config)


def test_a_config_is_read_from_toml(tmp_path):
    path = tmp_path / "kvconn.toml"
    path.write_text(
        'model = "m"\nbackend = "lmdb"\nnamespace = "prod"\n[options]\npath = "/data"\n'
    )
    cfg = ConnectorConfig.from_toml(path)
    assert (cfg.namespace, cfg.options["path"]) == ("prod", "/data")
    path.write_text("model = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        ConnectorConfig.from_toml(path)
    with pytest.raises(ConfigError, match="does not exist"):
        ConnectorConfig.from_toml(tmp_path / "missing.toml")


def test_environment_variables_overlay_the_file_and_set_backend_options(tmp_path):
    path = tmp_path / "kvconn.toml"
    path.write_text('model = "m"\n[options]\npath = "/data"\nmap_size = 1\n')
    env = {
        "KVCONN_CONFIG": str(path),
        "KVCONN_WRITER_POLICY": "first",
        "KVCONN_OPTION_MAP_SIZE": "1073741824",
        "KVCONN_STAGING_BYTES": "1048576",
        "PATH": "/usr/bin",
    }
    cfg = ConnectorConfig.from_env(env)
    assert cfg.writer_policy is WriterPolicy.FIRST
    assert cfg.options == {"path": "/data", "map_size": 1 << 30}
    assert cfg.staging_bytes == 1 << 20


@pytest.mark.parametrize(
    ("given", "kept"), [("auto", "auto"), (" inherit ", "inherit"), ("6-7,9", "6-7,9"), (3, "3")]
)
def test_transfer_cpus_takes_auto_inherit_or_a_cpu_list(given, kept):
    assert ConnectorConfig.from_dict({"model": "m", "transfer_cpus": given}).transfer_cpus == kept
    env = {"KVCONN_MODEL": "m", "KVCONN_TRANSFER_CPUS": str(given)}
    assert ConnectorConfig.from_env(env).transfer_cpus == kept


def test_an_unknown_kvconn_environment_variable_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown environment variable\(s\): KVCONN_MODLE"):
        ConnectorConfig.from_env({"KVCONN_MODLE": "m"})


def test_an_unknown_backend_name_lists_the_installed_ones():
    with pytest.raises(BackendNotFound) as info:
        load_backend("nosuchstore")
    assert "lmdb" in info.value.installed
    assert "installed backends: " in str(info.value) and "lmdb" in str(info.value)


def test_the_installed_backends_are_listed_without_importing_them():
    code = (
        "import sys, kvconn.registry as r; r.installed_backends(); "
        "print('kvconn_lmdb' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert "lmdb" in installed_backends()


class _StubBackend(Backend):
    def _exists(self, keys):
        return []

    def _put(self, keys, values):
        return []

    def _get(self, keys, buffers, *, scratch):
        return []


class _NeedsMissingClient(_StubBackend):
    name = "needy"
    extra = "needy"
    client_modules = ("kvconn_no_such_client_module",)


def test_a_backend_whose_client_is_missing_names_the_extra_to_install(monkeypatch):
    monkeypatch.setattr("kvconn.registry.backend_class", lambda name: _NeedsMissingClient)
    with pytest.raises(BackendDependencyMissing, match=r"pip install 'kvconn\[needy\]'"):
        load_backend("needy")


def test_describe_backends_reports_usability():
    infos = {i.name: i for i in describe_backends()}
    assert infos["lmdb"].problem is None and infos["lmdb"].distribution == "kvconn"


# ------------------------------------------------ bad inputs and secrets (issue 11)


def test_the_repr_of_a_config_masks_passwords_in_options_and_urls():
    config = ConnectorConfig(
        model="m",
        backend="redis",
        options={"url": "redis://alice:s3cr3t@h:6379/0", "password": "s3cr3t", "db": 2},
    )
    for shown in (repr(config), str(config), repr([config])):
        assert "s3cr3t" not in shown
        assert "redis://alice:***@h:6379/0" in shown and "'password': '***'" in shown
        assert "'db': 2" in shown and "model='m'" in shown
    assert config.options["password"] == "s3cr3t"  # masked when shown, never changed


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: p.mkdir(), "is a directory, not a file"),
        (lambda p: p.write_bytes(b'\xff\xfemodel = "m"'), "is not UTF-8 text"),
        (lambda p: p.write_text("v = " + "[" * 5000), "is not valid TOML|cannot be read"),
    ],
    ids=["directory", "not-utf-8", "nested-too-deep"],
)
def test_a_configuration_file_that_cannot_be_read_is_a_config_error_naming_it(
    tmp_path, write, message
):
    path = tmp_path / "kvconn.toml"
    write(path)
    with pytest.raises(ConfigError, match=message) as info:
        ConnectorConfig.from_toml(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (None, "a configuration must be a table/dict, got NoneType"),
        ({"model": "m", "options": 5}, "options must be a table/dict, got int"),
        ({"model": "m", "options": {3: 1}}, "option names must be non-empty strings, got 3"),
        ({"model": "m", 3: 1}, r"unknown configuration key\(s\): 3"),
        ({"model": "m", "writer_policy": None}, "writer_policy must be a name"),
        ({"model": "m", "staging_bytes": "99999999T"}, "staging_bytes must be an int between 1"),
        ({"model": "m", "staging_bytes": "9" * 400}, "staging_bytes must be an int between 1"),
        ({"model": "m", "staging_bytes": 2.5}, "staging_bytes must be an int"),
        ({"model": "m", "retry_interval_s": 1e300}, "retry_interval_s must be a number of"),
        ({"model": "m", "retry_interval_s": "1"}, "retry_interval_s must be a number of"),
    ],
)
def test_values_of_the_wrong_type_or_absurd_size_are_config_errors(data, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_dict(data)


def test_options_that_are_not_a_table_are_refused_from_every_source(tmp_path):
    path = tmp_path / "kvconn.toml"
    path.write_text('model = "m"\noptions = 5\n')
    with pytest.raises(ConfigError, match="options must be a table/dict, got int"):
        ConnectorConfig.from_env({"KVCONN_CONFIG": str(path)})
    with pytest.raises(ConfigError, match="base options must be a table/dict"):
        ConnectorConfig.from_env({}, base={"model": "m", "options": "x"})
    with pytest.raises(ConfigError, match=r"KVCONN_OPTION_<NAME> needs a name"):
        ConnectorConfig.from_env({"KVCONN_MODEL": "m", "KVCONN_OPTION_": "1"})


def test_an_option_value_is_a_literal_only_when_it_is_one_whole_value():
    assert parse_literal("8") == 8 and parse_literal("true") is True
    assert parse_literal("no") == "no"
    assert parse_literal("1\nsync = true") == "1\nsync = true"  # not 1
    assert parse_literal("[" * 5000) == "[" * 5000


def _fake_distribution(root, monkeypatch, name, entry_points_txt):
    """Install a distribution with these entry points, for this test only."""
    from stevedore.extension import ExtensionManager

    # stevedore keeps the entry points it read once per process, in a class attribute
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
    monkeypatch.syspath_prepend(str(root))
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points_txt)


def test_two_distributions_registering_one_backend_name_is_a_clear_error(tmp_path, monkeypatch):
    """A third-party ``lmdb`` entry point (here one that is not even a class) made
    stevedore fail with "'int' object has no attribute '__qualname__'"."""
    _fake_distribution(tmp_path, monkeypatch, "shadow-kv", "[kvconn.backends]\nlmdb = errno:EIO\n")
    with pytest.raises(ConfigError, match="'lmdb' is registered by 2 installed distributions") as e:
        load_backend("lmdb", {"path": str(tmp_path / "store")})
    assert "shadow-kv (errno:EIO)" in str(e.value) and "kvconn (kvconn_lmdb:LmdbBackend)" in str(
        e.value
    )
    rows = [i for i in describe_backends() if i.name == "lmdb"]
    assert sorted(i.distribution for i in rows) == ["kvconn", "shadow-kv"]
    assert all("registered by 2" in (i.problem or "") for i in rows)


def test_an_entry_point_that_is_not_a_backend_class_is_named(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, monkeypatch, "odd-kv", "[kvconn.backends]\nodd = errno:EIO\n")
    with pytest.raises(ConfigError, match="'odd' resolves to 5, not a kvconn Backend subclass"):
        load_backend("odd")


class _Picky(_StubBackend):
    """A third-party backend whose constructor quotes its URL in a plain ValueError."""

    def __init__(self, url: str = "") -> None:
        raise ValueError(f"cannot parse {url}")


def test_a_backend_constructor_error_is_a_config_error_with_secrets_masked(monkeypatch):
    monkeypatch.setattr("kvconn.registry.backend_class", lambda name: _Picky)
    with pytest.raises(ConfigError, match=r"redis://u:\*\*\*@h") as info:
        load_backend("picky", {"url": "redis://u:hunter2@h"})
    assert "hunter2" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(ConfigError, match="options must be a table/dict, got int"):
        load_backend("picky", 5)  # type: ignore[arg-type]


class _Confined(_StubBackend):
    """A store whose user may only touch keys under ``allowed``."""

    instances: list["_Confined"] = []

    def __init__(self, allowed: str = "") -> None:
        self.allowed = allowed
        self.closed = False
        _Confined.instances.append(self)

    def check_access(self, key_prefix: str) -> None:
        if not key_prefix.startswith(self.allowed):
            raise ConfigError(f"keys under {key_prefix!r} are off limits")

    def close(self) -> None:
        self.closed = True


def test_load_backend_given_the_key_prefix_refuses_a_store_that_forbids_it_and_closes_it(
    monkeypatch,
):
    monkeypatch.setattr("kvconn.registry.backend_class", lambda name: _Confined)
    with pytest.raises(ConfigError, match="keys under 'kvconn/m/' are off limits"):
        load_backend("confined", {"allowed": "other/"}, key_prefix="kvconn/m/")
    assert _Confined.instances[-1].closed  # no connection left open behind the error
    load_backend("confined", {"allowed": "other/"}, key_prefix="other/m/")
    assert not _Confined.instances[-1].closed
    # without the prefix nothing is asked: the caller did not say which keys it uses
    load_backend("confined", {"allowed": "other/"})
    assert not _Confined.instances[-1].closed


def test_names_read_under_a_c_locale_make_the_keys_a_utf_8_locale_makes():
    escaped = "caf\u00e9".encode().decode("ascii", "surrogateescape")
    config = ConnectorConfig(model=escaped, namespace=escaped)
    assert (config.model, config.namespace) == ("caf\u00e9", "caf\u00e9")
    with pytest.raises(ConfigError, match="is not valid UTF-8 text"):
        ConnectorConfig(model="\udcff")
