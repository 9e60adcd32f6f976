"""A sample of the architecture zoo (tests/zoo.py) in one process: the
transpiled step against the eager step from the same start and the same
seeds, bit for bit. Whisper and ViT drew other dropout masks than eager
(dropout on a tensor that is not contiguous); Mamba took a compile-only
branch; Mixtral's experts call aten._grouped_mm, whose meta function refuses
float32; Longformer and Qwen2-MoE decide on tensor values; BEiT memoizes its
relative position index (capture/memoized.py); PatchTST's BatchNorm between
two transposes is laid out otherwise by CPU's kernel than by its meta
function (capture/kernel_layouts.py). tests/test_zoo.py runs the zoo on 2
ranks against DDP."""

import copy

import pytest
import torch

from tests import zoo
from transpiler import transpile
from transpiler.errors import TranspileError

# (switch_transformers, whose routing decisions trace about 30 s, runs in `make zoo`)
SAMPLE = ["whisper", "mamba", "bert", "t5", "vit", "beit", "mixtral", "qwen2_moe", "deepseek_v3",
          "gpt2", "wav2vec2", "longformer", "clip", "resnet", "patchtst"]

pytestmark = pytest.mark.skipif(zoo.T is None, reason="transformers is not installed")


@pytest.mark.parametrize("name", SAMPLE)
def test_architecture_equals_eager(name):
    arch = zoo.by_name(name)
    step = zoo.step_of(arch)

    torch.manual_seed(0)
    ours = arch.build()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs)]
    transpiled, g = transpile(step), torch.Generator().manual_seed(1)
    if arch.refused:
        with pytest.raises(TranspileError, match=arch.refused):
            transpiled(ours, opts[0], arch.batch(g))
        return
    for i in range(3):
        b = arch.batch(g)
        torch.manual_seed(10 + i)
        a = transpiled(ours, opts[0], b)
        torch.manual_seed(10 + i)
        e = step(theirs, opts[1], b)
        assert torch.equal(a, e), f"call {i}: loss {a} != {e}"
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p, q), f"{n} differs by {(p - q).abs().max():.3g}"
