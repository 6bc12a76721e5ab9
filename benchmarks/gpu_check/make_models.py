"""The GPU check's models: real architectures from torchvision (random weights: latency needs no training),
saved as TorchScript files, one per model. Without torchvision (a CPU-only dry run), small conv nets instead."""
import sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
try:
    import torchvision.models as tv
    nets = {"mobilenet_v3_large": tv.mobilenet_v3_large, "resnet18": tv.resnet18, "resnet50": tv.resnet50}
    make = {name: (lambda f=f: f(weights=None)) for name, f in nets.items()}
except Exception as e:  # noqa: BLE001  any import failure: the dry run's small nets
    print(f"make_models: no torchvision ({e}); small conv nets instead", file=sys.stderr)

    def small(width):
        return torch.nn.Sequential(torch.nn.Conv2d(3, width, 3, stride=2), torch.nn.ReLU(),
                                   torch.nn.Conv2d(width, width, 3, stride=2), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, 10))
    make = {f"convnet_w{w}": (lambda w=w: small(w)) for w in (16, 32, 64)}
for name, build in make.items():
    model = build().eval()
    traced = torch.jit.trace(model, torch.randn(1, 3, 224, 224))
    traced.save(str(out / f"{name}.pt"))
    print(name, sum(p.numel() for p in model.parameters()))
