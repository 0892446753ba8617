import subprocess
import sys

import pytest

from kvconn.backend import Backend
from kvconn.config import ConnectorConfig
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
        ("writer_policy", "rank0", "writer_policy"),
        ("options", "path=/x", "options must be a table"),
        ("backend", "", "backend must be"),
    ],
)
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_dict({"model": "m", field: value})


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


def test_an_unknown_kvconn_environment_variable_is_an_error():
    with pytest.raises(ConfigError, match="unknown environment variable KVCONN_MODLE"):
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


class _NeedsMissingClient(Backend):
    name = "needy"
    extra = "needy"
    client_modules = ("kvconn_no_such_client_module",)

    def _exists(self, keys):
        return []

    def _put(self, keys, values):
        return []

    def _get(self, keys, buffers):
        return []


def test_a_backend_whose_client_is_missing_names_the_extra_to_install(monkeypatch):
    monkeypatch.setattr("kvconn.registry.backend_class", lambda name: _NeedsMissingClient)
    with pytest.raises(BackendDependencyMissing, match=r"pip install 'kvconn\[needy\]'"):
        load_backend("needy")


def test_describe_backends_reports_usability():
    infos = {i.name: i for i in describe_backends()}
    assert infos["lmdb"].problem is None and infos["lmdb"].distribution == "kvconn"
