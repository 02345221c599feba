r"""Model FLOPs utilisation (MFU): the FLOPs the model needs per second, over what the hardware can do.

FLOPs per token, for a GPT of $L$ blocks of width $d$ on a context of $T$ tokens (Kaplan et al.
2020; PaLM's appendix B counts the same; nanoGPT's `estimate_mfu` too):

$$6\,\Psi_{\text{mm}} + 12\,L\,d\,T$$

- $6\Psi_{\text{mm}}$: each parameter that multiplies an activation costs 2 FLOPs per token
  forward and 4 backward. $\Psi_{\text{mm}}$ is every parameter but the token and position
  embeddings, which are looked up, not multiplied (the output head is a matmul and counts;
  norms and biases are in it too, a rounding error).
- $12LdT$: attention's two matmuls, $QK^\top$ and the weighted sum of $V$, $2 \cdot 2dT$ FLOPs
  per token and block forward, three times that with backward. Counted over the whole
  $T \times T$ square, as PaLM does, although a causal kernel skips half of it.

These are the model's FLOPs: recomputation (--recompute) does a forward again, which the
hardware pays and MFU does not count (that ratio is HFU). The peak is the device's dense
(no 2:4 sparsity) bf16 tensor-core rate from NVIDIA's datasheets, whatever --precision is:
fp32 runs are measured against the same peak they could reach in bf16.
"""

import re

# Dense bf16 tensor-core peaks in TFLOPS, by a pattern of torch.cuda.get_device_name(). The datasheets
# give the rate with 2:4 sparsity (marked *); the dense rate is half of it. Sources:
#   H100 SXM5, H100 PCIe, H100 NVL: NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979* / 1,513* / 1,671*
#   H200 SXM, H200 NVL: NVIDIA H200 datasheet: BF16 1,979* / 1,671*
#   A100 (SXM4 and PCIe, 40 and 80 GB): NVIDIA A100 datasheet: BF16 312 (624*)
#   L40S: NVIDIA L40S datasheet: BF16 362.05 (733*)
#   L4: NVIDIA L4 datasheet: BF16 242*
#   A10: NVIDIA A10 datasheet: BF16 125 (250*)
#   GeForce RTX 4090: NVIDIA Ada GPU architecture whitepaper, appendix: peak BF16 tensor TFLOPS with FP32
#     accumulate 165.2 (330.4*) (PyTorch's bf16 matmuls accumulate in fp32)
# Not here: A10G (AWS's variant of the A10, clocked lower, with no NVIDIA datasheet figure) and any GPU
# not listed: give --peak-tflops.
PEAK_BF16_TFLOPS = (
    (r"H100.*PCIe", 756.5),
    (r"H100.*NVL", 835.5),
    (r"H100", 989.5),
    (r"H200.*NVL", 835.5),
    (r"H200", 989.5),
    (r"A100", 312.0),
    (r"L40S", 362.05),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
    (r"RTX 4090", 165.2),
)


def peak_tflops(device_name):
    """The dense bf16 peak of a GPU named `device_name` (torch.cuda.get_device_name), or None if unknown."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def matmul_parameters(model):
    """Ψ_mm of a zerokit.models.TinyTransformer: its parameters but the token and position embeddings."""
    looked_up = {id(model.embed.weight), id(model.pos.weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in looked_up)


def flops_per_token(model):
    """6 Ψ_mm + 12 L d T of a zerokit.models.TinyTransformer (the module docstring)."""
    layers, dim = len(model.blocks), model.embed.embedding_dim
    return 6 * matmul_parameters(model) + 12 * layers * dim * model.seq_len


def device_peak(device, given=None):
    """(TFLOPS per device, where the figure comes from) for MFU: --peak-tflops if given, else the
    table's figure for a known GPU; (None, why) where there is none (the CPU, an unknown GPU)."""
    if given is not None:
        return given, "--peak-tflops"
    if device.type != "cuda":
        return None, "no peak for a CPU: give --peak-tflops"
    import torch

    name = torch.cuda.get_device_name(device)
    found = peak_tflops(name)
    if found is None:
        return None, f"{name} is not in zerokit.train.speed's table: give --peak-tflops"
    return found, f"{name}, dense bf16"


def mfu(tokens_per_s, per_token, peak, devices):
    """The fraction of `devices` x `peak` TFLOPS that `tokens_per_s` tokens of `per_token` FLOPs use."""
    if not tokens_per_s or not peak:
        return None
    return tokens_per_s * per_token / (peak * 1e12 * devices)
