"""The CLI works on the checkout it runs in (found from the current folder upward, or --manifest), also
when installed without -e; --version; one message for an unreachable Hub; a token check before any
upload and --create-pr; `check` without libtpu's start-up noise, with i/N, the time left and a timeout."""

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from doubles import make_kernel
from fakehub import FakeHub

from pallas_hub import __version__, cli
from pallas_hub.hub import manifest
from pallas_hub.hub.publish import version_files

REPO = "pallas-hub-tests/double-tpu"


def _checkout(root: Path) -> Path:
    """A hub checkout of its own: a manifest and one (test double) kernel."""
    make_kernel(root / "kernels")
    shutil.move(root / "kernels" / "double-tpu", root / "kernels" / "double")
    (root / "build.toml").write_text('[hub]\nnamespace = "pallas-hub-tests"\n[kernels.double]\npath = "kernels/double"\n')
    return root


def test_commands_work_on_the_checkout_they_run_in(tmp_path, monkeypatch, capsys):
    other = _checkout(tmp_path / "other")
    monkeypatch.chdir(other / "kernels" / "double" / "torch-ext")  # anywhere inside it: found upward
    assert cli.main(["build"]) == 0
    assert f"-> {other / 'kernels' / 'double' / 'build'}" in capsys.readouterr().out
    assert (other / "kernels" / "double" / "build" / "torch-cpu" / "metadata.json").is_file()
    assert cli.main(["list", "--local-hub", str(tmp_path / "hub")]) == 0
    assert f"manifest {other / 'build.toml'}: namespace pallas-hub-tests, 1 kernel(s)" in capsys.readouterr().out

    monkeypatch.chdir(tmp_path)  # outside any checkout: a message, or --manifest
    assert cli.main(["list"]) == 2
    assert "no hub manifest (build.toml with a [hub] table) in" in capsys.readouterr().err
    assert cli.main(["--manifest", str(other / "build.toml"), "publish", "--local-hub", str(tmp_path / "hub")]) == 0
    assert cli.main(["list", "--manifest", str(other), "--local-hub", str(tmp_path / "hub")]) == 0
    assert "local hub" in capsys.readouterr().out and (tmp_path / "hub" / "kernels--pallas-hub-tests--double-tpu").is_dir()


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"pallas-hub {__version__}"


def test_a_non_editable_install_works_on_the_checkout_it_runs_in(tmp_path):
    """The wheel (what `pip install .` installs) holds everything the CLI needs, and nothing ties it to this checkout."""
    source, wheels = tmp_path / "source", tmp_path / "wheels"  # a copy: setuptools writes build/ where it builds
    shutil.copytree(manifest.ROOT / "loader", source / "loader", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(manifest.ROOT / "pyproject.toml", source)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(wheels), str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    site = tmp_path / "site"
    with zipfile.ZipFile(next(wheels.glob("*.whl"))) as whl:
        whl.extractall(site)
    other = _checkout(tmp_path / "other")
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    run = lambda *argv: subprocess.run(  # noqa: E731
        [sys.executable, "-c", "import sys, pallas_hub.cli as c; print('MODULE', c.__file__); sys.exit(c.main())", *argv],
        cwd=other, env=env, capture_output=True, text=True, timeout=600)
    got = run("publish", "--local-hub", str(tmp_path / "hub"))
    assert got.returncode == 0, got.stderr[-2000:]
    assert f"MODULE {site}" in got.stdout and "published: pallas-hub-tests/double-tpu v1" in got.stdout
    assert (other / "kernels" / "double" / "build" / "torch-tpu" / "_bridge.py").is_file()  # vendored from the wheel
    got = run("--version")
    assert got.stdout.strip().endswith(f"pallas-hub {__version__}")
    got = run("new", "softplus")  # the templates are in the wheel
    assert got.returncode == 0, got.stderr[-2000:]
    assert (other / "kernels" / "softplus" / "torch-ext" / "softplus_tpu" / "pallas.py").is_file()


def test_list_says_once_that_the_hub_is_unreachable(tmp_path, monkeypatch, capsys):
    import socket

    root = _checkout(tmp_path / "co")
    make_kernel(root / "kernels", name="second-tpu")
    shutil.move(root / "kernels" / "second-tpu", root / "kernels" / "second")
    with open(root / "build.toml", "a") as f:
        f.write('[kernels.second]\npath = "kernels/second"\n')
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.chdir(root)
    assert cli.main(["list", "--endpoint", dead, "--local-hub", str(tmp_path / "hub")]) == 0
    out = capsys.readouterr().out
    assert out.count("unreachable") == 1 and out.count("cannot reach the Hub") == 1, out


def _no_token(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file either
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))


def test_publish_to_the_hub_checks_for_a_token_before_any_request(tmp_path, monkeypatch, capsys):
    _no_token(tmp_path, monkeypatch)
    spec = manifest.load_kernel(make_kernel(tmp_path / "src"))
    with FakeHub() as fake:
        assert cli.main(["publish", "--path", str(spec.path), "--endpoint", fake.url]) == 1
        err = capsys.readouterr().err
        assert f"no Hugging Face token, so nothing was sent to {fake.url}" in err and "hf auth login" in err
        assert fake.requests == []


def test_create_pr_opens_pull_requests_and_leaves_the_branches(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    spec = manifest.load_kernel(make_kernel(tmp_path / "src"))
    with FakeHub() as fake:
        assert cli.main(["publish", "--path", str(spec.path), "--endpoint", fake.url, "--create-pr"]) == 1
        assert f"{REPO} does not exist at {fake.url}; a pull request needs" in capsys.readouterr().err
        assert cli.main(["publish", "--path", str(spec.path), "--endpoint", fake.url]) == 0  # a maintainer publishes v1
        v1, card = fake.resolve(REPO, "v1"), fake.resolve(REPO, "main")
        (spec.source / "__init__.py").write_text((spec.source / "__init__.py").read_text() + "\nCHANGED = True\n")
        (spec.path / "CARD.md").write_text("# double-tpu\n\nA better card.\n")
        assert cli.main(["publish", "--path", str(spec.path), "--endpoint", fake.url, "--create-pr"]) == 0
        out = capsys.readouterr().out
        assert f"{REPO}@v1: pull request {fake.url}/kernels/{REPO}/discussions/1" in out
        assert (fake.resolve(REPO, "v1"), fake.resolve(REPO, "main")) == (v1, card)  # nothing committed to them
        assert [(p["base"]) for p in fake.pulls] == ["v1", "main"]
        proposed = fake.repos[REPO]["commits"][fake.pulls[0]["commit"]]
        assert proposed == version_files(spec)  # the pull request holds exactly the new build
        assert cli.main(["publish", "--path", str(spec.path), "--local-hub", str(tmp_path / "hub"), "--create-pr"]) == 2


MATRIX = '''
import time

import jax
import jax.numpy as jnp

from pallas_hub.verify.matrix import Config


def _slow(x, y):
    time.sleep(600)  # stands for a configuration whose compile stalls
    return x


def configs(kernel):
    f = kernel.pallas.scale_add
    spec = (jax.ShapeDtypeStruct((64, 128), jnp.float32),) * 2
    return [Config("quick", f, spec, chips=("v6e",)), Config("stalls", _slow, spec, chips=("v6e",)),
            Config("quick after it", f, spec, dict(alpha=2.0), chips=("v6e",))]
'''


@pytest.mark.tpu_compile
def test_check_shows_progress_stops_a_stalled_configuration_and_keeps_libtpu_quiet(tmp_path):
    kernel = tmp_path / "scale_add"
    shutil.copytree(manifest.ROOT / "tests" / "fixtures" / "scale_add", kernel)
    (kernel / "compile_matrix.py").write_text(textwrap.dedent(MATRIX))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", "import sys; from pallas_hub.cli import main; sys.exit(main())",
                           "check", "--path", str(kernel), "--timeout", "20"], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert lines[0].startswith("[1/3 ") and "left] scale-add-tpu" in lines[0] and " v6e    compiled (" in lines[0]
    assert lines[1].startswith("[2/3 ") and "stalls" in lines[1] and "timed out: still compiling after 20s" in lines[1]
    assert lines[2].startswith("[3/3 ") and "quick after it" in lines[2] and "compiled" in lines[2]  # a new worker
    assert "1 not as declared" in done.stdout
    for noise in ("E0000", "INVALID_ARGUMENT", "could not determine TPU", "InitGoogle"):
        assert noise not in done.stderr + done.stdout, done.stderr


def test_check_names_a_compile_matrix_that_does_not_import(tmp_path, capsys):
    kernel = tmp_path / "scale_add"
    shutil.copytree(manifest.ROOT / "tests" / "fixtures" / "scale_add", kernel)
    (kernel / "compile_matrix.py").write_text("import jax\n\nraise ImportError('broken on purpose')\n")
    assert cli.main(["check", "--path", str(kernel)]) == 2
    assert capsys.readouterr().err.strip() == (f"pallas-hub: the kernels could not be built and imported for the compile "
                                               f"matrix: {kernel / 'compile_matrix.py'}:3: ImportError: broken on purpose")


def test_bench_runs_the_named_problems_and_implementations(monkeypatch, capsys):
    """`bench --problem NAME --impl TEXT` hands the runner only those rows (a subset run: results/partial/);
    an unknown problem or a text no implementation name contains is refused, naming what there is."""
    from types import SimpleNamespace

    from pallas_hub.bench import runner

    impls = [SimpleNamespace(name=n, family="decode") for n in
             ("ours: paged_attention", "jax paged_attention", "vLLM TPU ragged_paged_attention v3")]
    monkeypatch.setattr(runner, "implementations", lambda families, paths=(): impls)
    calls = []
    monkeypatch.setattr(runner, "run", lambda *a, **kw: calls.append(kw) or {"rows": []})
    names = ["Qwen3 decode B=8 page 16", "Qwen3 decode B=64 page 128"]
    args = ["bench", "--families", "decode", "--problem", names[0], "--problem", names[1], "--impl", "ours",
            "--impl", "vLLM", "--no-bridge", "--no-xla"]
    assert cli.main(args) == 0
    (kw,) = calls
    assert [p.name for p in kw["problem_list"]] == names
    assert [i.name for i in kw["impl_list"]] == [impls[0].name, impls[2].name]
    assert cli.main(["bench", "--families", "decode"]) == 0  # no filter: the runner picks (None)
    assert calls[-1]["problem_list"] is None and calls[-1]["impl_list"] is None

    assert cli.main(["bench", "--families", "decode", "--problem", "Qwen3 decode B=3"]) != 0
    err = capsys.readouterr().err
    assert "no problem named 'Qwen3 decode B=3' in decode" in err and names[0] in err
    assert cli.main(["bench", "--families", "decode", "--impl", "splash"]) != 0
    assert "no implementation's name contains 'splash'" in capsys.readouterr().err
    assert len(calls) == 2
