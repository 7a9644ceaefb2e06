"""The RoPE kernel with YaRN frequencies and scale against the reference, at long-context
positions (around 2^17 = 128K tokens, 2^31 / head_dim and 2^31), on CUDA or under the interpreter."""
import pytest
import torch

from kernels import reference
from kernels.rope import rope

from tests.kernels.conftest import DEVICE

# as test_layer_ops: fp32, cos/sin of the same fp32 angle from two libms agree to ~1e-7 (also for
# angles of 2^31 rad: both reduce the argument exactly); fp16, one rounding of a product may
# fall on the other side: 1 fp16 ulp at |x| ~ 4
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=4e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d, heads", [(64, 16), (128, 14)])  # the 0.5B's 14 + 2 and the 1.5B's 12 + 2 heads
# 128K tokens; 2^31 / 64, where a position times a row of 64 leaves int32; positions past int32
@pytest.mark.parametrize("first", [2**17 - 3, 2**25 - 3, 2**31 - 3])
def test_yarn_rope_matches_reference(dtype, d, heads, first):
    g = torch.Generator().manual_seed(d + heads)
    qkv = torch.randn(6, (heads + 2) * d, generator=g).to(dtype).to(DEVICE)
    x = qkv[:, :heads * d].view(6, heads, d)  # strided rows, as the fused QKV output
    pos = torch.arange(first, first + 6, device=DEVICE)
    inv_freq, scale = reference.rope_inv_freq(d, 1e6, DEVICE, factor=4.0, orig_ctx=32768)
    out = rope(x, pos, inv_freq, scale)
    ref = reference.rope(x, *reference.rope_angles(pos, inv_freq, dtype, scale))
    torch.testing.assert_close(out, ref, **TOL[dtype])
    plain = reference.rope(x, *reference.rope_angles(pos, inv_freq, dtype))
    assert (out.float() - plain.float()).abs().max() > 0.05  # the scale is applied (1.139 x |x| ~ 3)


def test_rope_wants_int64_positions():
    with pytest.raises(ValueError, match="pos must be int64"):
        rope(torch.zeros(1, 2, 8, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE),
             torch.zeros(4, device=DEVICE))
