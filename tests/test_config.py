"""Config: sizes, budgets, precedence of env over file, and messages that name the key."""

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from weightcache.config import Budget, DaemonConfig, load_settings
from weightcache.errors import ConfigError
from weightcache.units import parse_size


@pytest.mark.parametrize(("text", "n"), [("6GiB", 6 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                         (1024, 1024), ("4096", 4096), ("2 KiB", 2048)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["6 parsecs", "-1", "GiB", True, -5])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_budget_forms():
    assert Budget.parse("0.8").resolve(1000) == 800
    assert Budget.parse(0.5).resolve(1000) == 500
    assert Budget.parse("1").resolve(1000) == 1000  # "1" alone is the whole device
    assert Budget.parse("2MiB").resolve(1000) == 2 * 2**20
    with pytest.raises(ValueError):
        Budget.parse(1.5)


@pytest.mark.parametrize("path", ["configs/example.toml", "examples/systemd/weightcache.toml",
                                  "examples/kubernetes/weightcache.toml"])
def test_shipped_configs_are_valid(path, monkeypatch):
    # Their groups (weightcache-clients, ...) are made by the deployment steps, not here.
    monkeypatch.setattr("weightcache.config.checks.grp.getgrnam", lambda name: SimpleNamespace(gr_gid=4242))
    s = load_settings(path)
    assert s.models and s.budgets


def test_file_then_env_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[daemon]\nsocket = "/tmp/x.sock"\nlog_level = "info"\n[budgets]\ncpu = "1GiB"\n'
                   '[[models]]\nname = "m"\npath = "rel/m.safetensors"\n')
    s = load_settings(cfg)
    assert str(s.models[0].path) == str(tmp_path / "rel/m.safetensors")  # relative to the file
    monkeypatch.setenv("WEIGHTCACHE_DAEMON__LOG_LEVEL", "debug")
    monkeypatch.setenv("WEIGHTCACHE_SOCKET", "/tmp/env.sock")
    s = load_settings(cfg)
    assert s.daemon.log_level == "debug" and str(s.daemon.socket) == "/tmp/env.sock"
    assert s.budgets["cpu"].nbytes == 2**30  # untouched keys keep the file's value


@pytest.mark.parametrize(
    ("body", "expect"),
    [
        ('[budgets]\ncpu = "6 parsecs"', "budgets"),
        ('[daemon]\nmax_frame_bytes = "lots"', "daemon.max_frame_bytes"),
        ('[daemon]\nsokcet = "/x"', "daemon.sokcet"),
        ('[[models]]\nname = "m"', "needs either path"),
        ('[[models]]\nname = "m"\npath = "/x"\ndevice = "cuda:0"', "no entry in [budgets]"),
        ('[[models]]\nname = "bad name!"\npath = "/x"', "models.0.name"),
        ('[[models]]\nname = "m"\npath = "/x"\n[[models]]\nname = "m"\npath = "/y"', "appears twice"),
        ("[daemon\n", "not valid TOML"),
        ("\udcff[daemon]", "is not UTF-8 text (byte 0)"),  # was a UnicodeDecodeError traceback
        ('[budgets]\ncpu = "1.5"', "budgets.cpu: "),  # was a budget of 1 byte
        ('[budgets]\ncpu = "1.5"', "for a size give a unit"),
        ('[budgets]\ncpu = "0"', "budgets.cpu: "),
        ('[budgets]\ncpu = "0"', "holds nothing"),
        ('[[models]]\nname = "m"\npath = "/x"\nkeep_alive = "1 week"', "use seconds, or a number with s, m, h or d"),
        ('[daemon]\nmax_loaded_models = {cpu = 0}', "max_loaded_models.cpu must be a whole number >= 1"),
        ('[daemon]\nmax_loaded_models = {"cuda:0" = 2}', "max_loaded_models names device 'cuda:0'"),
        # An operator's typos (issue of h2): each was accepted as something else, or a traceback at start.
        ('[budgets]\ncpu = "8G"', "budgets.cpu: '8G' is ambiguous: write '8GiB'"),  # was 8e9 bytes
        ('[daemon]\nhost_budget = "64g"', "daemon.host_budget: '64g' is ambiguous"),
        ('[budgets]\ncpu = 8', "budgets.cpu: '8' has no unit: give a size such as '8GiB'"),  # was a budget of 8 bytes
        ('[budgets]\ncpu = "4096"', "has no unit"),  # below 1 MiB: a unit forgotten; 1048576 and up are bytes
        ('[daemon]\nsocket_group = "wc-no-such-group"', "daemon.socket_group: no group named 'wc-no-such-group'"),
        ('[daemon]\nallowed_gids = ["wc-no-such-group"]', "daemon.allowed_gids: no group named"),  # these three:
        ('[daemon]\nadmin_gids = ["wc-no-such-group"]', "daemon.admin_gids: no group named"),  # a traceback at start
        ('[daemon]\nsocket_mode = 660', "write it in octal: socket_mode = 0o660"),  # was "less than or equal to 511"
        ('[[models]]\nname = "m"\npath = "/x"\nkeep_alive = -1', "or leave keep_alive out"),
        ('[[models]]\nname = "m"\npath = "/x"\nkeep_alive = "-1"', "or leave keep_alive out"),
        ('[[models]]\nname = "m"\npath = "/x"\nkeep_alive = 0', "give a time > 0"),
        ('[daemon]\nshutdown_grace_s = "ten"', "daemon.shutdown_grace_s: not a duration: 'ten'"),
        # a rate written as one: the key's name already says "per second"
        ('[daemon]\nmax_read_bytes_per_s_per_uid = "64MiB/s"', "daemon.max_read_bytes_per_s_per_uid: not a size: '64MiB/s'"),
        ('[daemon]\nmax_read_bytes_per_s_per_uid = -1', "daemon.max_read_bytes_per_s_per_uid: size must be >= 0"),
        ('[daemon]\nloop_stall_s = "100ms"', "daemon.loop_stall_s: not a duration: '100ms'"),
        ('[daemon]\nloop_stall_s = -0.1', "daemon.loop_stall_s: Input should be greater than or equal to 0"),
        ('[daemon]\nload_depth = 0', "daemon.load_depth: Input should be greater than or equal to 1"),
        ('[daemon]\nload_page_cache_dma = "yes"', "daemon.load_page_cache_dma: Input should be 'auto', 'on' or 'off'"),
    ],
)
def test_invalid_configs_name_the_key(tmp_path, body, expect):
    cfg = tmp_path / "c.toml"
    cfg.write_text(body + "\n", errors="surrogateescape")  # lets a body hold a non-UTF-8 byte
    with pytest.raises(ConfigError) as info:
        load_settings(cfg)
    assert expect in info.value.message


def test_serve_with_invalid_config_exits_2_with_one_clear_message(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[budgets]\ncpu = "lots"\n')
    r = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "budgets" in r.stderr and "Traceback" not in r.stderr


def test_a_byte_budget_larger_than_the_device_refuses_to_start(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[daemon]\nsocket = "{tmp_path}/s.sock"\n[budgets]\ncpu = "900TiB"\n')
    r = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "budgets.cpu" in r.stderr and "more than the device" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s.sock").exists()


def test_config_text_writes_what_load_settings_reads(tmp_path):
    # spawn.config_text writes the configs of the demo, the benchmarks and the tests.
    from weightcache.tools.spawn import config_text

    shards = [{"path": "/m/rank0", "device": "cuda:0"}, {"path": "/m/rank1", "device": "cuda:1"}]
    models = [{"name": "tp", "shards": shards}, {"name": "odd", "path": '/m/a "b"\\c', "pin": True, "keep_alive": 1.5}]
    cfg = tmp_path / "c.toml"
    cfg.write_text(config_text("/tmp/x.sock", {"cpu": "1GiB", "cuda:0": "0.5", "cuda:1": "2GiB"}, models, {"max_connections": 7}))
    s = load_settings(cfg)
    assert s.daemon.max_connections == 7 and set(s.budgets) == {"cpu", "cuda:0", "cuda:1"}
    tp, odd = s.models
    assert [(str(p.path), p.device) for p in tp.shards] == [("/m/rank0", "cuda:0"), ("/m/rank1", "cuda:1")]
    assert (str(odd.path), odd.pin, odd.keep_alive) == ('/m/a "b"\\c', True, 1.5)


def test_the_example_config_shows_every_daemon_key():
    """configs/example.toml says it shows every key: each [daemon] and [peers] setting
    appears, set or commented out, so an operator finds every knob (new limits included)
    in one place."""
    from weightcache.config import PeersConfig

    text = (Path(__file__).parents[1] / "configs" / "example.toml").read_text()
    shown = set(re.findall(r"^#? ?([a-z_]+) = ", text, re.M))
    missing = sorted((set(DaemonConfig.model_fields) | set(PeersConfig.model_fields)) - shown)
    assert not missing, f"configs/example.toml does not show: {missing}"


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("5m", 300), ("1h", 3600), ("1.5h", 5400), (90, 90)])
def test_keep_alive_takes_durations(tmp_path, text, seconds):
    cfg = tmp_path / "c.toml"
    value = f'"{text}"' if isinstance(text, str) else text
    cfg.write_text(f'[[models]]\nname = "m"\npath = "/x"\nkeep_alive = {value}\n')
    assert load_settings(cfg).models[0].keep_alive == seconds


def test_a_config_error_names_its_key_once_without_pydantics_prefix(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[budgets]\ncpu = "6 parsecs"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(cfg)
    line = info.value.message.splitlines()[1].strip()
    assert line.startswith("budgets.cpu: not a size: '6 parsecs'"), line  # was "budgets: Value error, budgets.cpu: ..."


def test_durations_octal_modes_home_and_relative_socket(tmp_path, monkeypatch):
    """What an operator writes as in a shell or for keep_alive is read that way."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WEIGHTCACHE_SOCKET", raising=False)
    cfg = tmp_path / "etc" / "c.toml"
    cfg.parent.mkdir()
    cfg.write_text('[daemon]\nsocket = "run/wc.sock"\nsocket_mode = "660"\nshutdown_grace_s = "30s"\n'
                   'request_timeout_s = "15m"\nno_space_wait_s = 5\n'
                   '[[models]]\nname = "m"\npath = "~/models/m.safetensors"\n')
    s = load_settings(cfg)
    assert s.daemon.socket_mode == 0o660  # was 660 decimal, refused as "less than or equal to 511"
    assert (s.daemon.shutdown_grace_s, s.daemon.request_timeout_s, s.daemon.no_space_wait_s) == (30, 900, 5)
    assert str(s.models[0].path) == str(tmp_path / "home" / "models" / "m.safetensors")  # was <config dir>/~/models/...
    assert str(s.daemon.socket) == str(tmp_path / "etc" / "run" / "wc.sock")  # was relative to the daemon's cwd
    cfg.write_text('[daemon]\nsocket = "~/wc.sock"\n')
    assert str(load_settings(cfg).daemon.socket) == str(tmp_path / "home" / "wc.sock")


def test_a_size_with_one_letter_is_refused_and_with_a_unit_read(tmp_path):
    assert parse_size("8 GB") == parse_size("8gb") == 8 * 10**9
    assert parse_size("8GiB") == Budget.parse("8 GiB").nbytes == 8 * 2**30
    assert Budget.parse(1).fraction == 1.0  # as "1": the whole device, not one byte
    assert Budget.parse(2**20).nbytes == Budget.parse(str(2**28)).nbytes // 256 == 2**20  # what tools/workload writes
    assert Budget.parse("80%").fraction == 0.8 and Budget.parse("100 %").fraction == 1.0  # was "not a size"
    for text in ("150%", "0%"):
        with pytest.raises(ValueError, match=r"must be in \(0%, 100%\]"):
            Budget.parse(text)
    for text in ("8G", "8g", "512M", "4k", "2T"):
        with pytest.raises(ValueError, match="is ambiguous"):
            parse_size(text)


def test_the_systemd_daemon_may_give_its_socket_to_socket_group(monkeypatch):
    """chown(2) to a group needs membership: with socket_group set, a daemon user outside
    that group fails at start ("Operation not permitted"), as examples/systemd's did."""
    root = Path(__file__).parents[1] / "examples" / "systemd"
    monkeypatch.setattr("weightcache.config.checks.grp.getgrnam", lambda name: SimpleNamespace(gr_gid=4242))
    group = load_settings(root / "weightcache.toml").daemon.socket_group
    unit = dict(line.split("=", 1) for line in (root / "weightcache.service").read_text().splitlines()
                if "=" in line and not line.startswith("#"))
    assert group in [unit["Group"], *unit.get("SupplementaryGroups", "").split()], unit


@pytest.mark.parametrize(("body", "line"), [
    ('[daemon]\nsokcet = "/x"', "daemon.sokcet: unknown key; did you mean 'socket'?"),  # was "Extra inputs are not permitted"
    ('[[models]]\nname = "m"\npth = "/x"', "models.0.pth: unknown key; did you mean 'path'?"),
    ('[quotas."uid:1000"]\nbyte = 5', "quotas.uid:1000.byte: unknown key; did you mean 'bytes'?"),
    ('[budget]\ncpu = "1GiB"', "budget: unknown key; did you mean 'budgets'?"),
    ('[daemon]\nzzzzz = 1', "daemon.zzzzz: unknown key; configs/example.toml shows every key"),
])
def test_an_unknown_key_names_the_closest_known_one(tmp_path, body, line):
    cfg = tmp_path / "c.toml"
    cfg.write_text(body + "\n")
    with pytest.raises(ConfigError) as info:
        load_settings(cfg)
    assert info.value.message.splitlines()[1].strip() == line


def test_a_bad_value_from_the_environment_names_the_variable(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[budgets]\ncpu = "1GiB"\n')
    monkeypatch.setenv("WEIGHTCACHE_DAEMON__LOGLEVEL", "debug")
    with pytest.raises(ConfigError) as info:
        load_settings(cfg)  # the message said "in c.toml", which holds no such key
    assert "daemon.loglevel: unknown key; did you mean 'log_level'? (from $WEIGHTCACHE_DAEMON__LOGLEVEL)" in info.value.message


def test_a_config_path_that_is_a_directory_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:  # was IsADirectoryError's traceback
        load_settings(tmp_path)
    assert info.value.message == f"config file {tmp_path} cannot be read: Is a directory"


def test_the_readmes_configuration_is_valid(tmp_path, monkeypatch):
    """A newcomer copies the README's config: it named cuda:1 for a shard without a budget for it."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    cfg = tmp_path / "c.toml"
    cfg.write_text(block)
    monkeypatch.setattr("weightcache.config.checks.grp.getgrnam", lambda name: SimpleNamespace(gr_gid=4242))
    s = load_settings(cfg)
    assert {m.name for m in s.models} == {"qwen-7b"} and "cuda:0" in s.budgets


def test_a_missing_file_named_by_the_environment_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.message == f"config file {tmp_path / 'gone.toml'} does not exist (named by $WEIGHTCACHE_CONFIG; " \
                                 "pass --config or fix the variable)"


def test_problems_of_one_model_are_one_line_each():
    """For the daemon's register op, which answered with pydantic's four-line dump and URL."""
    from pydantic import ValidationError

    from weightcache.config import ModelConfig, problems

    with pytest.raises(ValidationError) as info:
        ModelConfig(name="bad name", path="/x", device="gpu", keep_alive=0, pth="/y")
    lines = problems(info.value, ModelConfig)
    assert lines[0].startswith("name: model name 'bad name' must be") and len(lines) == 4, lines
    assert "device: device 'gpu' must be" in lines[1] and lines[2].startswith("keep_alive: keep_alive = 0")
    assert lines[3] == "pth: unknown key; did you mean 'path'?"
    assert not any("pydantic.dev" in line or "\n" in line for line in lines)


def test_the_default_budget_is_the_documented_one(tmp_path):
    """Without [budgets] the daemon holds up to half the host's memory on the CPU and no
    GPU; neither README nor example.toml said so."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[daemon]\nsocket = "/tmp/x.sock"\n')
    assert load_settings(cfg).budgets == {"cpu": Budget.parse("0.5")}
    root = Path(__file__).parents[1]
    assert 'Without a [budgets] table the daemon uses cpu = "0.5"' in (root / "configs" / "example.toml").read_text()
    assert 'without this table: cpu = "0.5" and no GPU' in (root / "README.md").read_text()
