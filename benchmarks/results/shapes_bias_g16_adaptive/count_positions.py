"""Where the adaptive planner puts the causal fold's anchors on shapes at groups of 16.

    PYTHONPATH=. python benchmarks/results/shapes_bias_g16_adaptive/count_positions.py

Three rollouts of 8 prompts x 16 samples at the base weights (generator seeds 100-102), one
on-policy minibatch each through ``adaptive_causal_b2`` and ``adaptive_causal_b2_5`` (the
quality study's settings, ``benchmarks.train_phase.trainers``); every call of
``planner.adaptive_choice`` is recorded and its per-sample anchor sets counted.  Output:
``positions.txt`` next to this file.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch

import jagg_autograd.planner as planner
from benchmarks.train_phase import one_minibatch, rollout_minibatch, trainers

NAMES = ("adaptive_causal_b2", "adaptive_causal_b2_5")


def main() -> None:
    torch.set_num_threads(1)
    trs = trainers("shapes", 8, 16, NAMES)
    seen: list[torch.Tensor] = []
    choose = planner.adaptive_choice

    def recording(*a, **k):  # type: ignore[no-untyped-def]
        res = choose(*a, **k)
        seen.append(res.mask.clone())
        return res

    planner.adaptive_choice = recording
    lines = []
    for seed in (100, 101, 102):
        mb = rollout_minibatch(trs["exact"], seed)
        adv = mb.adv
        for name in NAMES:
            seen.clear()
            one_minibatch(trs[name], mb, seed)
            for mask in seen:
                sets = collections.Counter(
                    tuple(int(i) for i in torch.nonzero(mask[:, b]).flatten())
                    for b in range(mask.shape[1])
                )
                lines.append(f"{name} seed {seed}: anchor sets (of steps 0-4) {dict(sets)}; "
                             f"samples with advantage 0: {int((adv == 0).sum())}")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text, end="")
    (Path(__file__).parent / "positions.txt").write_text(text)


if __name__ == "__main__":
    main()
