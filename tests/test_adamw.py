"""optim.AdamW's fused update against the multi-tensor (foreach) one it replaced, and the kernel's step count."""

import torch

import optim
from optim import AdamW


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(300, 32),
        torch.nn.Linear(32, 64),
        torch.nn.LayerNorm(64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 300),
    )


def _train(model, opt, steps, lr_of_step):
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        optim.set_lr(opt, lr_of_step(i))
        opt.zero_grad(set_to_none=True)
        x = torch.randint(0, 300, (8, 12), generator=g)
        torch.nn.functional.cross_entropy(
            model(x).flatten(0, 1), x.roll(-1, 1).flatten()
        ).backward()
        opt.step()


def test_fused_update_equals_the_foreach_update_to_rounding():
    # today's numbers were torch.optim.AdamW(foreach=True)'s bit for bit (the order of its foreach ops)
    ours, ref = _model(), _model()
    opt = AdamW(
        optim.param_groups(ours, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    ref_opt = torch.optim.AdamW(
        optim.param_groups(ref, 0.1),
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        foreach=True,
    )
    lr = lambda i: 1e-2 * min(1.0, (i + 1) / 10)  # noqa: E731  warm-up: a new lr every step at first
    _train(ours, opt, 40, lr)
    _train(ref, ref_opt, 40, lr)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-9
        )
    moved = max(
        (p - q).abs().max().item() for p, q in zip(ours.parameters(), _model().parameters())
    )
    assert moved > 0.05  # it trained: far more than the differences allowed above


def test_parameters_at_different_steps_each_get_their_own_bias_correction():
    # a parameter whose state was reset (step 0) next to one at step 20: each its own bias correction
    model, ref = _model(), _model()
    opt = AdamW(optim.param_groups(model, 0.0), lr=1e-2)
    ref_opt = torch.optim.AdamW(optim.param_groups(ref, 0.0), lr=1e-2, foreach=True)
    _train(model, opt, 20, lambda i: 1e-2)
    _train(ref, ref_opt, 20, lambda i: 1e-2)
    first, ref_first = next(model.parameters()), next(ref.parameters())
    del opt.state[first], ref_opt.state[ref_first]
    _train(model, opt, 3, lambda i: 1e-2)
    _train(ref, ref_opt, 3, lambda i: 1e-2)
    assert opt.state[first]["step"] == 3 and opt.state[model[1].weight]["step"] == 23
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
