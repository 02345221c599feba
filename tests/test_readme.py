"""What the README's package section shows works as written after `import zerokit`.

Every ```python block between "## The package" and "## Instructors" runs, unchanged, on two
gloo ranks, after a prelude that only supplies the names the README leaves to the reader: a
model (`make_model()`, a fresh `model`), `loss_fn`, this rank's batches and a function `fn` to
launch. A block that fails, or names something zerokit does not have, fails this test.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_ranks

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = '''
import torch
import zerokit
from zerokit.models import TinyTransformer, loss_for, make_batch

def make_model():
    torch.manual_seed(0)
    return TinyTransformer(vocab=101, dim=22, n_layers=2, n_heads=2, seq_len=9)

def loss_fn(logits, targets):
    return loss_for("transformer", logits, targets)

def fn(rank, world_size):
    return rank

model = make_model()
x_local, y_local = make_batch("transformer", 4, seed=RANK, vocab=101, seq_len=9)
(x, y), (x1, y1), (x2, y2) = [make_batch("transformer", 4, seed=10 * RANK + k, vocab=101, seq_len=9) for k in range(3)]
'''


def package_blocks():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The package"):readme.index("## Instructors")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _run_block(rank, world_size, block, folder):
    import os

    os.chdir(folder)
    namespace = {}
    exec(PRELUDE.replace("RANK", str(rank)), namespace)
    exec(compile(block, "README.md", "exec"), namespace)
    return sorted(k for k in namespace if not k.startswith("__"))


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(package_blocks())))
def test_every_code_block_of_the_package_section_runs_as_written(index, tmp_path):
    block = package_blocks()[index]
    # a block that launches ranks of its own does it from each rank here: the fork server
    # launcher keeps those nested launches light
    import zerokit

    names = zerokit.launch(_run_block, 2, args=(block, str(tmp_path)), backend="gloo", launcher="forkserver",
                           timeout=120, echo=False, env={"ZEROKIT_LAUNCHER": "forkserver"})
    assert names[0] == names[1]


def test_the_package_section_has_the_blocks_it_promises():
    text = "\n".join(package_blocks())
    for name in ("zerokit.DataParallel(", "zerokit.ZeRO1(", "zerokit.FullyShard(", "zerokit.ZeRO2Adam(",
                 "zerokit.checkpoint.save(", "zerokit.launch("):
        assert name in text, name


def test_names_the_readme_writes_in_prose_resolve_after_import_zerokit():
    """`zerokit.checkpoint.dcp.to_dcp`, as the Checkpoints section writes it, in a fresh process."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The package"):readme.index("## Instructors")]
    dotted = sorted(set(re.findall(r"`(zerokit(?:\.[A-Za-z_]\w*)+)", section)))
    assert "zerokit.checkpoint.dcp.to_dcp" in dotted
    code = "import functools, operator, zerokit\n" + "".join(
        f"functools.reduce(getattr, {name.split('.')[1:]!r}, zerokit)\n" for name in dotted)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
