"""A plain torchvision training script: ImageFolder, the standard transforms, torch's DataLoader.

Nothing here knows about fastload; it is what `fastload profile -- python examples/train_torchvision.py DIR`
diagnoses in the README ("Why is my GPU idle?").
"""

import argparse

import torch
from torch import nn
from torchvision import datasets, models, transforms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="an ImageFolder tree (class folders of images)")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--pin-memory", action="store_true")
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tf = transforms.Compose([
        transforms.RandomResizedCrop(args.image_size),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    data = datasets.ImageFolder(args.data, tf)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                         pin_memory=args.pin_memory, drop_last=True)
    model = getattr(models, args.model)(num_classes=len(data.classes)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 50 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
