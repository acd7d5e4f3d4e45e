"""The wheel installs beside transformers >= 5.25 and Hugging Face's `kernels` package: it takes no import name of
theirs, and installing or uninstalling it changes none of their files. Slow: it builds the wheel and makes a venv
(PyPI, or pip's cache, brings transformers 5.25 and `kernels` into it)."""
import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import ROOT

THEIRS = ["transformers==5.25.0", "kernels==0.19.1"]
CHECK = ("import kernels, transformers; from kernels import get_kernel, kernelize; "
         "from transformers.integrations import hub_kernels; "
         "print(transformers.__version__, kernels.__file__)")


def run(*args: str, cwd: Path) -> str:
    out = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{' '.join(args)}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def their_files(python: Path, cwd: Path) -> dict[str, str]:
    """sha256 of every file the `transformers` and `kernels` distributions installed (their RECORDs)."""
    code = ("import hashlib, importlib.metadata as m, json\n"
            "out = {}\n"
            "for d in ('transformers', 'kernels'):\n"
            "    for f in m.distribution(d).files:\n"
            "        p = f.locate()\n"
            "        if p.is_file(): out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()\n"
            "print(json.dumps(out))")
    return json.loads(run(str(python), "-c", code, cwd=cwd))


@pytest.mark.slow
def test_the_wheel_lives_beside_transformers_and_their_kernels_package(tmp_path):
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
        str(ROOT), cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("eagle3_trainer-*.whl")
    # their dependencies (numpy, torch, huggingface-hub...) come from this environment
    venv.create(tmp_path / "env", system_site_packages=True, with_pip=True)
    python = tmp_path / "env" / "bin" / "python"
    # --ignore-installed: into the venv itself, beside where ours will go, even where this environment has them too
    run(str(python), "-m", "pip", "install", "-q", "--ignore-installed", "--no-deps", *THEIRS, cwd=tmp_path)
    assert run(str(python), "-c", CHECK, cwd=tmp_path).startswith("5.25.0 " + str(tmp_path / "env"))
    before = their_files(python, tmp_path)
    assert any(name.endswith("/kernels/__init__.py") for name in before)

    run(str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel), cwd=tmp_path)
    assert their_files(python, tmp_path) == before
    run(str(python), "-c", CHECK, cwd=tmp_path)
    ours = ("import eagle3.kernels.reference as r, eagle3.models, eagle3.data; print(r.__file__)")
    assert "/env/lib/" in run(str(python), "-c", ours, cwd=tmp_path)

    run(str(python), "-m", "pip", "uninstall", "-q", "-y", "eagle3-trainer", cwd=tmp_path)
    assert their_files(python, tmp_path) == before
    run(str(python), "-c", CHECK, cwd=tmp_path)


def test_the_source_tree_takes_no_top_level_kernels_package():
    """The top-level kernels/ folder holds modules only: no __init__.py that would shadow Hugging Face's package
    whenever the repository root is on sys.path (as `python -m pytest` puts it)."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    code = "import eagle3.kernels.ttt_attention as t, eagle3.kernels.reference as r; print(t.__name__, r.__file__)"
    out = run(sys.executable, "-c", code, cwd=ROOT)
    assert out.split()[0] == "eagle3.kernels.ttt_attention" and out.split()[1] == str(ROOT / "kernels" / "reference.py")
