"""What a newcomer runs first: the README's quick start, extracted from README.md as ``.ci/run`` extracts the test
command, run with torchrun as the README says; and ``examples/train.py``. Both train on data whose loss falls."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
MARGIN = 1.0
"""Both fall from about 4.2 to 2.3-2.7 in ten steps (counting sequences, AdamW at lr 1e-2): more than this."""


def _block(name: str) -> str:
    """The fenced block between ``<!-- name -->`` and ``<!-- /name -->`` in README.md, without its fences."""
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- {name} -->\n```[a-z]*\n(.*?)```\n<!-- /{name} -->", text, re.S)
    assert found, f"README.md has no <!-- {name} --> block"
    return found.group(1)


def _losses(output: str) -> list[float]:
    return [float(loss) for loss in re.findall(r"^step \d+ loss ([\d.]+)$", output, re.M)]


def _run(command: list[str], cwd: pathlib.Path, **environ: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **environ}
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written_and_its_loss_falls(tmp_path: pathlib.Path) -> None:
    (tmp_path / "quickstart.py").write_text(_block("quick-start"))
    output = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "quickstart.py"], tmp_path)
    losses = _losses(output)
    assert len(losses) == 10 and losses[-1] < losses[0] - MARGIN, output


@pytest.mark.slow
def test_the_example_trains_as_the_unsharded_model_and_its_loss_falls(tmp_path: pathlib.Path) -> None:
    """As a user runs it (Inductor, every default option) and as docs/debugging.md runs it, dumping what the compiler
    did for ``explain``: its steps' shape (4 sequences of 16 tokens a rank, as many as the vocabulary, and the quick
    start's) once hid wrong gradients ([Note: shared bodies])."""
    dump = tmp_path / "dump"
    output = _run([sys.executable, "examples/train.py"], ROOT, FSDP_COMPILE_DUMP=str(dump))
    losses = _losses(output)
    assert len(losses) == 10 and losses[-1] < losses[0] - MARGIN, output
    assert re.search(r"parity vs unsharded single-process model: .* \(tolerance 1e-05\): OK", output), output
    explained = _run([sys.executable, "-m", "fsdp_compile", "explain", str(dump)], ROOT)
    assert re.search(r"shared body \w+: compiled once for forward and once for backward, run by 4 units", explained), \
        explained
