"""Readable numeric comparisons for the checks: what was expected, what came out, where.

The torch functions used here are captured when this module is imported, before any
student code runs in the worker, so replacing torch's comparison functions changes nothing
(and the harness reports the replacement as tampering).
"""

import torch
import torch.distributed as dist

_abs, _max, _isfinite, _all = torch.abs, torch.max, torch.isfinite, torch.all
_argmax, _nonzero, _count_nonzero, _unravel = torch.argmax, torch.nonzero, torch.count_nonzero, torch.unravel_index

# (atol, rtol) per dtype: fp32 checks after many Adam steps stay well inside 1e-5
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10),
              torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _where():
    """' on rank 1' where several ranks run the check; nothing on one process."""
    return f" on rank {dist.get_rank()}" if dist.is_initialized() and dist.get_world_size() > 1 else ""


def max_abs_diff(actual, expected):
    return float(_max(_abs(actual.detach().double() - expected.detach().double())))


def assert_close(actual, expected, what, atol=None, rtol=None):
    """Raise AssertionError("<what> differs ... max |difference| ...") unless allclose."""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}{_where()}")
    d_atol, d_rtol = TOLERANCES.get(expected.dtype, (1e-5, 1e-5))
    atol, rtol = d_atol if atol is None else atol, d_rtol if rtol is None else rtol
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not bool(_all(_isfinite(a))) and bool(_all(_isfinite(e))):
        raise AssertionError(f"{what}: your result contains NaN or inf{_where()}")
    err = _abs(a - e)
    bad = err > atol + rtol * _abs(e)
    if bool(bad.any()):
        flat_a, flat_e, flat_err = a.reshape(-1), e.reshape(-1), err.reshape(-1)
        first = int(_nonzero(bad.reshape(-1))[0])
        worst = int(_argmax(flat_err))

        def element(i):
            return f"element {_index(i, a.shape)}: expected {float(flat_e[i]):.6g}, got {float(flat_a[i]):.6g}"

        where = (f"the first, {element(first)}, is also the largest difference ({float(flat_err[first]):.3g})"
                 if first == worst else
                 f"the first, {element(first)} (|difference| {float(flat_err[first]):.3g}); "
                 f"the largest difference, {float(flat_err[worst]):.3g} at {element(worst)}")
        raise AssertionError(
            f"{what} differs{_where()}: {int(_count_nonzero(bad))} of {bad.numel()} elements beyond the tolerance "
            f"({atol:g} + {rtol:g}*|expected|); {where}")


def _index(i, shape):
    """'#7' for a flat tensor, '[1, 3]' for a matrix (the position a student indexes it with)."""
    if len(shape) <= 1:
        return f"#{i}"
    return "[" + ", ".join(str(int(k)) for k in _unravel(torch.tensor(i), tuple(shape))) + "]"
