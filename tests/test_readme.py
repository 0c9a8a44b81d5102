"""The README's Python examples run as written, on the CPU, and give the shapes their comments
state (the examples that need a download, transformers' from_pretrained, are the integration
tests' instead: tests/test_transformers_integration.py).

Each example is taken from README.md itself (a ```python block), so an edit that breaks one
fails here. For the CPU, "cuda" becomes "cpu", and the first example's 4096 tokens become
256 (the blockwise path in bf16 on two cores); nothing else is changed. Names an example uses
without defining them (idx, targets; the JAX example's q, k, v) are given beforehand. Each
runs in a fresh Python as a user's would: without the suite's TRITON_INTERPRET=1, so
backend "auto" takes the PyTorch path on CPU tensors, as it does for a user."""

import json
import os
import re

import pytest

from conftest import run_uninterpreted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_examples():
    """The ```python blocks of README.md, dedented, in order."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", text, flags=re.S | re.M)
    return [re.sub(rf"^{indent}", "", body, flags=re.M) for indent, body in blocks]


def example(starting_with):
    """The one README example whose code starts with `starting_with`, made to run on a CPU."""
    found = [code for code in readme_examples() if code.startswith(starting_with)]
    assert len(found) == 1, f"README: {len(found)} examples start with {starting_with!r}"
    return found[0].replace('device="cuda"', 'device="cpu"')


def run(code, prelude="", report=()):
    """Run prelude + code in a fresh Python on the CPU; returns {name: value} for each
    expression of `report` ({name: expression}), evaluated after the code (JSON values)."""
    shown = ", ".join(f"{name!r}: {expr}" for name, expr in dict(report).items())
    program = "\n".join([prelude, code, f"import json; print(json.dumps({{{shown}}}))"])
    out = run_uninterpreted("-c", program, timeout=300, CUDA_VISIBLE_DEVICES="")
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_readme_has_the_examples_tested_here():
    assert len(readme_examples()) == 6


def test_attention_example():
    code = example("import torch, longflash").replace("4096", "256")
    got = run(code, report=dict(o="list(o.shape)", lse="list(lse.shape)", dtype="str(lse.dtype)",
                                out="list(out.shape)"))
    assert got == dict(o=[2, 256, 16, 128], lse=[2, 16, 256], dtype="torch.float32",
                       out=[2, 16, 256, 128])  # out: (batch, nheads, seqlen, headdim)


def test_decoding_example():
    got = run(example("k_cache = torch.zeros"), "import torch, longflash",
              dict(tree="list(tree.shape)", o="list(o.shape)", length="int(lengths[0])",
                   appended="bool(k_cache[:, 100].abs().sum() > 0)",
                   o_mla="list(o_mla.shape)", latent="bool(latents[:, 100].abs().sum() > 0)"))
    # o: the float8 cache's step; the first step appended its key at row 100, the MLA step
    # its latent
    assert got == dict(tree=[1, 1, 7, 108], o=[8, 1, 32, 128], length=101, appended=True,
                       o_mla=[8, 1, 16, 512], latent=True)


def test_shared_prefix_example():
    """After the decoding example's names (q, k_new, v_new), as in the README."""
    prelude = "import torch, longflash\n" + example("k_cache = torch.zeros")
    got = run(example("prompt_k, prompt_v = "), prelude,
              dict(o="list(o.shape)", appended="bool(own_k[:, 0].abs().sum() > 0)"))
    assert got == dict(o=[8, 1, 32, 128], appended=True)


def test_gpt_example(tmp_path):
    """The context-parallel part on a group of one rank (gloo): the ring of one."""
    prelude = ("import torch\ngen = torch.Generator().manual_seed(0)\n"
               "idx, targets = (torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2))\n"
               "import torch.distributed as dist\n"
               f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, "
               "world_size=1)")
    got = run(example("from longflash.models import GPT"), prelude,
              dict(logits="list(logits.shape)", loss="loss.dim()", out="list(out.shape)",
                   grad="cp.wte.weight.grad is not None"))
    assert got == dict(logits=[2, 32, 256], loss=0, out=[2, 32 + 100], grad=True)


def test_jax_example():
    pytest.importorskip("jax", reason="jax not installed: pip install .[jax]")
    prelude = ("import jax\nkeys = jax.random.split(jax.random.PRNGKey(0), 3)\n"
               "q, k, v = (jax.random.normal(key, (1, 64, 4, 32)) for key in keys)\n"
               "q1, k1, v1 = q[:, :1], k[:, :1, :2], v[:, :1, :2]  # a step's token, 2 KV heads\n"
               "k_cache, v_cache = k[:, :, :2] * 0, v[:, :, :2] * 0  # 64 tokens a sequence\n"
               "cache_seqlens = jax.numpy.array([10])")
    got = run(example("import jax, longflash.jax"), prelude,
              dict(o="list(o.shape)", dq="list(dq.shape)", k_cache="list(k_cache.shape)",
                   appended="bool((k_cache[:, 10] == k1[:, 0]).all())"))
    assert got == dict(o=[1, 1, 4, 32], dq=[1, 64, 4, 32], k_cache=[1, 64, 2, 32], appended=True)
