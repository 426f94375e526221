"""Every bad input of the k3gen command line is one typed line on stderr and exit 2, found before
any work starts; the help names choices and defaults; printed target names are accepted."""
import os
import subprocess
import sys

import pytest

from k3gen.cli import ARCH_CHOICES, parser


def k3gen(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "k3gen", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def assert_one_line_error(p, needle, code=2):
    assert p.returncode == code, (p.returncode, p.stderr, p.stdout)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], p.stderr
    assert needle in lines[0], p.stderr


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    return f


@pytest.mark.parametrize("args,needle", [
    (("build", "--arch", "sm90", "-j", "-3"), "-3 is out of range"),
    (("build", "--arch", "sm90", "-j", "two"), "'two' is not an integer"),
    (("build", "--arch", "sm90", "--model", "tiny", "--tp", "0"), "0 is out of range"),
    (("build", "--arch", "sm90", "--model", "tiny", "--tp", "-2"), "-2 is out of range"),
    (("build", "--arch", "sm90", "--model", "tiny", "--drafts", "1,a"), "each draft count is an integer in 0..7"),
    (("build", "--arch", "sm90", "--model", "tiny", "--drafts", "9"), "in 0..7"),
    (("build", "--arch", "sm90", "--model", "tiny", "--drafts", ""), "in 0..7"),
    (("build", "--arch", "sm89"), "invalid choice: 'sm89'"),
    (("build", "--arch", "sm90", "--kv", "fp4"), "invalid choice: 'fp4'"),
    (("build", "--arch", "sm90", "--model", "no_such_model"), "model='no_such_model'"),
    (("build", "--arch", "sm90", "--drafts", "3"), "add --model"),
    (("list", "--arch", "sm80"), "invalid choice: 'sm80'"),
    (("show", ""), "kernel name is empty"),
    (("show", "   "), "kernel name is empty"),
    (("inspect", ""), "kernel name is empty"),
    (("show", "kv", "--arch", "sm90"), "matches 6 kernels"),
    (("show", "kv_cache_write__bf16"), "several targets"),
    (("bench", "--op", "nope"), "unknown op 'nope'"),
    (("cache", "repair"), "invalid choice: 'repair'"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
])
def test_bad_argument(args, needle):
    assert_one_line_error(k3gen(*args), needle)


def test_bench_unknown_op_lists_the_known_ones_before_any_gpu_check():
    p = k3gen("bench", "--op", "nope")
    assert_one_line_error(p, "unknown op")
    assert "kv_cache_write" in p.stderr and "mla_decode" in p.stderr and "GPU" not in p.stderr


@pytest.mark.parametrize("var,value,needle", [
    ("K3GEN_JOBS", "abc", "K3GEN_JOBS='abc' is not allowed; allowed: an integer 0..4096"),
    ("K3GEN_JOBS", "-1", "K3GEN_JOBS='-1'"),
    ("K3GEN_JOBS", "2.5", "K3GEN_JOBS='2.5'"),
    ("K3GEN_DISABLE_JIT", "maybe", "K3GEN_DISABLE_JIT='maybe'"),
    ("K3GEN_VALIDATE", "2", "K3GEN_VALIDATE='2'"),
    ("K3GEN_PDL", "enabled", "K3GEN_PDL='enabled'"),
    ("K3GEN_GPU", "perhaps", "K3GEN_GPU='perhaps'"),
    ("K3GEN_NVRTC_EXTRA", "-O3 maxrregcount=64", "maxrregcount=64 is not an option"),
    ("K3GEN_PROGRESS_SECONDS", "0", "K3GEN_PROGRESS_SECONDS='0'"),
    ("K3GEN_PROGRESS_SECONDS", "nan", "K3GEN_PROGRESS_SECONDS='nan'"),
])
def test_bad_setting_is_refused_before_any_work(var, value, needle, tmp_path):
    gen = tmp_path / "gen"
    gen.mkdir()
    p = k3gen("build", "--arch", "sm90", "--generated", str(gen), env={var: value})
    assert_one_line_error(p, needle)
    assert list(gen.iterdir()) == []   # the generated tree would be written first


@pytest.mark.parametrize("var,sub,needle", [
    ("K3GEN_CACHE_DIR", "", "cannot hold the kernel cache"),          # CacheError
    ("K3GEN_CACHE_DIR", "sub", "cannot hold the kernel cache"),
    ("K3GEN_DUMP", "", "is a file"),
    ("K3GEN_PREBUILT", "", "is a file"),
])
def test_setting_that_names_a_file_for_a_folder(var, sub, needle, a_file):
    path = str(a_file / sub) if sub else str(a_file)
    for args in (("cache", "info"), ("list", "--arch", "sm90"), ("build", "--arch", "sm90", "--model", "tiny")):
        assert_one_line_error(k3gen(*args, env={var: path}), needle)


def test_unusable_cache_raises_the_cache_error_class(a_file, monkeypatch):
    from k3gen.config import settings
    from k3gen.errors import CacheError
    monkeypatch.setenv("K3GEN_CACHE_DIR", str(a_file))
    with pytest.raises(CacheError):
        settings().cache_dir


def test_the_model_commands_get_the_settings_check_too():
    assert_one_line_error(k3gen("plan-memory", "--config", "small", env={"K3GEN_JOBS": "x"}), "K3GEN_JOBS='x'")


@pytest.mark.parametrize("content,needle", [("{not json", "not JSON"), ("[1, 2]", "not a JSON object"),
                                             ('{"model_type": "llama"}', "model_type")])
def test_bad_model_config_is_one_line(tmp_path, content, needle):
    cfg = tmp_path / "config.json"
    cfg.write_text(content)
    assert_one_line_error(k3gen("build", "--arch", "sm90", "--model", str(cfg)), needle)


def test_out_that_is_a_file(a_file):
    assert_one_line_error(k3gen("build", "--arch", "sm90", "--model", "tiny", "--out", str(a_file)), "is a file")


def _options(p):
    import argparse
    subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in subs.choices.items():
        if sp.add_help:   # generate / plan-memory are the model's parsers
            yield name, sp


def test_help_names_choices_and_defaults_of_every_option():
    import argparse
    seen = 0
    for name, sp in _options(parser()):
        text = sp.format_help()
        for act in sp._actions:
            if isinstance(act, argparse._HelpAction) or act.help == argparse.SUPPRESS:
                continue
            seen += 1
            assert act.help, (name, act.dest)
            for c in act.choices or ():
                assert str(c) in text, (name, act.dest, c)
            if act.default not in (None, False) and act.option_strings:
                assert f"default: {act.default}" in " ".join(text.split()), (name, act.dest)
    assert seen > 20


def test_every_printed_target_name_is_accepted():
    p = k3gen("list")
    assert p.returncode == 0, p.stderr
    names = {line.split("│")[1].strip() for line in p.stdout.splitlines() if line.startswith("│")}
    assert names == {"sm90", "sm100", "sm103", "sm107"}, names
    assert names <= set(ARCH_CHOICES)
    from k3gen.targets import TARGETS
    assert set(TARGETS) <= set(ARCH_CHOICES)   # the full names errors and the build table print
    assert k3gen("build", "--arch", "sm100-mxfp4", "--check").returncode == 0
