"""ResNet-50 with DDP under SLURM, rewritten without rank arithmetic or init_process_group.

The usual raw-DDP SLURM script computes ranks from SLURM variables, joins the process group,
pins the GPU, builds a DistributedSampler and wraps the model by hand. With anyaccel,
``Accelerator()`` reads ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``/``SLURM_NODELIST``
(first host = main address; the port is derived from the job id unless ``MASTER_PORT`` is set)::

    # before (raw DDP)                                           # after (anyaccel)
    rank = int(os.environ["SLURM_PROCID"])                       accelerator = Accelerator()
    world_size = int(os.environ["WORLD_SIZE"])
    gpus_per_node = int(os.environ["SLURM_GPUS_ON_NODE"])
    local_rank = rank - gpus_per_node * (rank // gpus_per_node)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(local_rank)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=bs, sampler=sampler) loader = DataLoader(dataset, batch_size=bs, shuffle=True)
    model = DDP(resnet50().to(local_rank), device_ids=[local_rank])
                                                                 model, optimizer, loader = accelerator.prepare(
                                                                     resnet50(), optimizer, loader)
    sampler.set_epoch(epoch)                                     # (automatic: each pass is a new epoch)
    x, y = x.to(local_rank), y.to(local_rank)                    # (gone: batches arrive on the device)
    loss.backward()                                              accelerator.backward(loss)
    if rank == 0: torch.save(model.module.state_dict(), p)       accelerator.save(accelerator.get_state_dict(model), p)
    dist.destroy_process_group()                                 accelerator.end_training()

Submit it with the batch scripts in ``examples/slurm/`` (they run ``srun python
examples/ddp_slurm_resnet.py ...``: one task per GPU; ``srun`` is what starts the tasks — a batch
script that runs ``python`` directly gets a single process and a warning, not a hang). Outside
SLURM the same file runs under ``anyaccel launch`` or ``torchrun``.

Output per epoch (main process): loss, accuracy on the validation split, wall time and
throughput in images per second over all processes; a checkpoint ``epoch_<n>.pt`` is written by
rank 0 after every epoch.
"""

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_common_args, image_datasets, vision_model  # noqa: E402

from anyaccel import Accelerator, set_seed  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, epochs=2, batch_size=32, lr=0.05)
    parser.add_argument("--arch", default="resnet50", help="torchvision model name, or 'small'")
    parser.add_argument("--image_size", type=int, default=None, help="default: 224 with --data, else 32")
    parser.add_argument("--num_workers", type=int, default=None, help="default: 4 with --data, else 0")
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    set_seed(args.seed)
    env = accelerator.environment
    accelerator.print(f"launched by {env.source}: {env.world_size} process(es) on {env.num_nodes} node(s), "
                      f"main {env.main_address}:{env.main_port}, device {accelerator.device}, "
                      f"backend {env.backend or '-'}")

    image_size = args.image_size or (224 if args.data else 32)
    workers = args.num_workers if args.num_workers is not None else (4 if args.data else 0)
    train_set, val_set, num_classes = image_datasets("imagefolder", args.data, image_size, 3, print_fn=accelerator.print,
                                                     limit=args.limit, synthetic=args.synthetic)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=workers,
                              pin_memory=accelerator.device.type == "cuda")
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, num_workers=workers)
    model = vision_model(args.arch, num_classes, 3, print_fn=accelerator.print)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss()

    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)

    os.makedirs(args.output_dir, exist_ok=True)
    job_start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        start = time.perf_counter()
        seen = 0
        for step, (x, y) in enumerate(train_loader):
            if args.max_steps is not None and step >= args.max_steps:
                break
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            seen += y.shape[0]
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        train_time = time.perf_counter() - start
        # images per second over the whole job: every rank trained `seen` images in this epoch
        images = accelerator.reduce(torch.tensor(float(seen), device=accelerator.device), "sum").item()
        mean_loss = accelerator.reduce(loss.detach(), "mean").item()

        model.eval()
        correct = total = 0
        for x, y in val_loader:
            with torch.no_grad():
                pred = model(x).argmax(dim=1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += (pred == y).sum().item()
            total += y.numel()

        path = os.path.join(args.output_dir, f"epoch_{epoch}.pt")
        accelerator.save({"epoch": epoch, "model": accelerator.get_state_dict(model),
                          "optimizer": optimizer.state_dict()}, path)  # rank 0 writes; no barrier inside
        accelerator.print(f"epoch {epoch}: loss {mean_loss:.4f}, val accuracy {correct / total:.4f}, "
                          f"train time {train_time:.2f} s, {images / train_time:.1f} images/s "
                          f"({int(images)} images on {accelerator.num_processes} processes), checkpoint {path}")

    accelerator.print(f"total time {time.perf_counter() - job_start:.2f} s")
    accelerator.end_training()


if __name__ == "__main__":
    main()
