"""The language-model loss: mean next-token cross-entropy over the vocabulary, plain or chunked.

- `lm_loss(logits, targets)`: on logits the head has made, (B, T, V), upcast to fp32: the step
  holds all b·s·V of them, and the loss's backward two more fp32 tensors of that size (the
  gradients of the log-probabilities and of the logits).
- `chunked_lm_loss(hidden, weight, targets, chunk)`: the head's matmul and the loss together,
  `chunk` tokens at a time (Liger's fused linear cross-entropy and Apple's Cut Cross-Entropy
  never build the logits either). The forward keeps, per token, only the log-sum-exp; the
  backward makes each chunk's logits again and turns them into the chunk's gradients for the
  hidden states and the head's weight. At most chunk·V logits exist at once: the whole-batch
  b·s·V tensors are gone, for one more head matmul per chunk in the backward.
Both compute the logits in the matmul's dtype (autocast's, where it is on) and the softmax in
fp32, so they agree within fp32 rounding (tests/test_losses.py). A target of IGNORE (-100, a pad's
or a document's last token) adds nothing: the mean is over the others, as cross_entropy's
`ignore_index`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

LOSSES = ("plain", "chunked")
IGNORE = -100  # cross_entropy's default ignore_index


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed on fp32 logits whatever the model's dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    chunk: int) -> torch.Tensor:
    """`lm_loss(hidden @ weight.T, targets)` without the (B, T, V) logits: `hidden` (B, T, d),
    `weight` the head's (V, d), `chunk` tokens of logits at a time."""
    return ChunkedLinearCrossEntropy.apply(hidden.flatten(0, 1), weight, targets.flatten(), chunk)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss = mean over the N tokens with a target of logsumexp(h W^T) - (h W^T)[target];
    dL/dlogits = (softmax - onehot) / N on those tokens (0 on an IGNORE one), so dL/dh = G W and
    dL/dW = G^T h, chunk by chunk. The backward runs under the autocast state of the forward, so
    its logits are the forward's again."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        device = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        kept = targets != IGNORE
        ctx.chunk, ctx.count = chunk, int(kept.sum())
        whole = ctx.count == len(targets)  # nothing ignored: no per-token mask needed
        safe = targets if whole else targets.clamp(min=0)  # an ignored token's logit counts 0 times
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(hidden[rows], weight).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            losses = lse[rows] - logits.gather(1, safe[rows, None]).squeeze(1)
            total += (losses if whole else losses * kept[rows]).sum()
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        return total / ctx.count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        scale = grad.float() / ctx.count
        safe = targets
        if ctx.count < len(targets):  # per token: 0 where the target is ignored
            scale, safe = (targets != IGNORE) * scale, targets.clamp(min=0)
        with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.shape[0], ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                g = F.linear(hidden[rows], weight).float().sub_(lse[rows, None]).exp_()  # softmax
                g[torch.arange(len(g), device=g.device), safe[rows]] -= 1
                g *= scale if scale.dim() == 0 else scale[rows, None]
                if grad_hidden is not None:
                    grad_hidden[rows] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(g.t(), hidden[rows].float())  # in place: no V x d temporary
                del g
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None)
