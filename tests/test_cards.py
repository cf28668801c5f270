"""The Hub cards stand alone: everything a card cites is published with it, and every command it shows works
against the published repository with the pinned versions (kernels 0.17.2, huggingface_hub 2.4), here a
loopback Hub holding what `pallas-hub publish --hub` uploads. A block that needs something else says so in
its fence: ```python kernels>=0.18.2 (transformers' own Hub route) or ```python tpu (a TorchTPU host).

`kernels benchmark` on a real kernel's download takes minutes in interpret mode: the default run does it for
the scaffolded kernel's card (the same command), `make test-slow` for every card; the scripts themselves run
under kernels' benchmark runner in tests/test_kernel_benchmarks.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fakehub import FakeHub

from pallas_hub.hub import manifest
from pallas_hub.hub.build import build_kernel
from pallas_hub.hub.publish import publish_hub

NOT_RUN_HERE = {"kernels>=0.18.2": "needs kernels 0.18.2 <= version < 0.19", "tpu": "needs a TorchTPU host"}
FENCE = re.compile(r"^```(\S+)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)")
# a path in backticks: under a folder of a kernel repository or checkout, or a file name with a known extension
PATH = re.compile(r"`((?:benchmarks|build|kernels|loader|tests|torch-ext)/[\w./-]*|[\w./-]+\.(?:py|md|txt|json|png|svg|toml))`")


def _scaffolded(root: Path) -> manifest.KernelSpec:
    from pallas_hub.hub.scaffold import new_kernel

    root.mkdir(parents=True)
    (root / "build.toml").write_text('[hub]\nnamespace = "pallas-hub"\n')
    spec, _ = new_kernel(manifest.load_manifest(root), "softplus")
    return spec


CARDS = sorted(manifest.load_manifest().kernels) + ["scaffolded"]


@pytest.fixture(params=CARDS)
def published(request, tmp_path):
    """(spec, the loopback Hub) with the kernel built and uploaded as `pallas-hub publish --hub` does."""
    from huggingface_hub import HfApi

    key = request.param
    spec = _scaffolded(tmp_path / "checkout") if key == "scaffolded" else manifest.load_manifest().kernels[key]
    with FakeHub() as fake:
        publish_hub(spec, build_kernel(spec, tmp_path / "build"), api=HfApi(endpoint=fake.url, token="hf_fake"),
                    progress=None)
        yield spec, fake


def test_a_card_cites_only_what_is_published_with_it(published):
    spec, fake = published
    text = (spec.path / "CARD.md").read_text()
    files = {**fake.files(spec.repo_id, f"v{spec.version}"), **fake.files(spec.repo_id, "main")}
    assert "PYTHONPATH" not in text and "pallas_hub" not in text, "the card needs the pallas-hub source to be read"
    for target in LINK.findall(text):
        if not re.match(r"^([a-z]+:|#)", target):
            assert target in files, f"the card links {target}, which is not published"
    for path in PATH.findall(text):
        assert any(f == path or f.startswith(path.rstrip("/") + "/") for f in files), \
            f"the card cites {path}, which is not published (published: {sorted(files)[:8]} ...)"


def _blocks(text: str):
    for lang, notes, body in FENCE.findall(text):
        notes = notes.split()
        assert lang in ("python", "bash"), f"a ```{lang} block: cards show python and bash only"
        assert set(notes) <= set(NOT_RUN_HERE), f"unknown note {notes} on a ```{lang} block; known: {NOT_RUN_HERE}"
        yield lang, notes, body


def _run_card(spec, fake, tmp_path, benchmark: bool) -> None:
    text = (spec.path / "CARD.md").read_text()
    runnable = [(lang, body) for lang, notes, body in _blocks(text) if not notes]
    assert any(lang == "python" for lang, _ in runnable) and any(lang == "bash" for lang, _ in runnable)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "HF_ENDPOINT": fake.url, "HF_HUB_CACHE": str(tmp_path / "hf"), "JAX_PLATFORMS": "cpu",
           "KERNELS_CACHE": str(tmp_path / "hf"), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("HF_TOKEN", None)  # a public repository: no token needed to use it
    work = tmp_path / "user"
    work.mkdir()
    script = "\n\n".join(f"# --- block {i}\n{body}" for i, (lang, body) in enumerate(runnable) if lang == "python")
    done = subprocess.run([sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"{spec.path / 'CARD.md'}: a python block failed:\n{done.stderr[-3000:]}"
    for lang, body in runnable:
        if lang != "bash":
            continue
        for line in filter(None, (raw.strip() for raw in body.splitlines())):
            if line.startswith("kernels benchmark"):
                if not benchmark:
                    continue
                line += " --iterations 2 --warmup 1"  # the same command, fewer runs (interpret mode is slow)
            done = subprocess.run(line, shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
            assert done.returncode == 0, f"{spec.path / 'CARD.md'}: `{line}` failed:\n{done.stderr[-3000:]}"


def test_every_command_of_a_card_works_against_the_published_repo(published, tmp_path):
    spec, fake = published
    _run_card(spec, fake, tmp_path, benchmark=spec.key == "softplus")


@pytest.mark.slow
def test_every_card_with_its_kernels_benchmark_command(published, tmp_path):
    spec, fake = published
    if spec.key == "softplus":
        pytest.skip("the default run does this one")
    _run_card(spec, fake, tmp_path, benchmark=True)
