"""A training script in the shape of diffusers' ``examples/*/train_*.py`` (v0.40:
train_unconditional.py, train_text_to_image.py, train_dreambooth.py), written here and written
**for Accelerate**: tests/compat/test_diffusers_shapes_multiprocess.py runs it as it is under Accelerate,
and under anyaccel after the import swap that docs/guides/accelerate.md prints (``sed``).

What it keeps of those scripts, line for line in spirit: ``import accelerate`` and the version gate
``version.parse(accelerate.__version__) >= version.parse("0.16.0")`` around the save/load pre-hooks
that write ``unet/`` and ``unet_ema/`` (``save_pretrained``) and pop the weights; diffusers'
``UNet2DModel`` (tiny) and ``EMAModel``; the learning rate scaled by ``num_processes``; trackers
started on the main process only and ``accelerator.log`` on every rank; ``accumulate`` and
``sync_gradients``; the ``checkpoints_total_limit`` pruning and ``save_state`` on the main process
only (on every process under DeepSpeed); validation on the main process with the EMA weights
(``unwrap_model``, ``get_tracker(..., unwrap=True)``, ``accelerator.trackers``); resume with
``--resume_from_checkpoint latest``: ``load_state`` on every process, ``first_epoch`` and
``resume_step`` computed from the checkpoint's step and the batches already done passed over with
``continue``; ``end_training``.

``main()`` runs four times in one process (:data:`RUNS`, one launch): a run interrupted after 4
optimizer steps (in the middle of an epoch, in one process and in two: 6 or 3 steps per epoch),
resumed from its newest checkpoint to step 6 (the end of an epoch), resumed again from there (an
epoch boundary) to step 8, and an uninterrupted run of 8 steps in another directory: the chain's
final weights must equal the uninterrupted run's bit for bit. Every rank prints one
``FACTS {json}`` line per run; the test compares them.
"""

import argparse
import hashlib
import json
import math
import os
import shutil

import accelerate
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, ProjectConfiguration, set_seed
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from packaging import version

logger = get_logger(__name__, log_level="INFO")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_train_steps", type=int, default=8)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--checkpointing_steps", type=int, default=2)
    parser.add_argument("--checkpoints_total_limit", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--train_batch_size", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    return parser.parse_args()


class Images(torch.utils.data.Dataset):
    """24 fixed random 3x8x8 "images", as dict batches (diffusers' datasets give {"input": ...})."""

    def __init__(self):
        self.images = torch.rand(24, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return {"input": self.images[i]}


def tiny_unet():
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                       norm_num_groups=4)


def flat(parameters):
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in parameters])


def digest(parameters):
    """The exact bits of ``parameters``: equal digests are bitwise-equal weights."""
    return hashlib.sha256(flat(parameters).numpy().tobytes()).hexdigest()[:16]


def main(args, run):
    resume = bool(args.resume_from_checkpoint)
    logging_dir = os.path.join(args.output_dir, "logs")
    accelerator_project_config = ProjectConfiguration(project_dir=args.output_dir, logging_dir=logging_dir)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, log_with="tensorboard",
                              project_config=accelerator_project_config)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    # train_text_to_image.py's deepspeed_zero_init_disabled_context_manager()
    deepspeed_plugin = AcceleratorState().deepspeed_plugin if accelerate.state.is_initialized() else None
    facts = {"rank": accelerator.process_index, "run": run, "accelerate_version": accelerate.__version__,
             "deepspeed_plugin": deepspeed_plugin is not None}
    set_seed(0)
    model = tiny_unet()
    ema_model = EMAModel(model.parameters(), decay=0.9, use_ema_warmup=True, model_cls=UNet2DModel,
                         model_config=model.config)

    facts["hooks"] = False
    # `accelerate` 0.16.0 will have better support for customized saving
    if version.parse(accelerate.__version__) >= version.parse("0.16.0"):
        facts["hooks"] = True

        def save_model_hook(models, weights, output_dir):
            if accelerator.is_main_process:
                ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
                for i, model in enumerate(models):
                    model.save_pretrained(os.path.join(output_dir, "unet"))
                    # make sure to pop weight so that corresponding model is not saved again
                    weights.pop()

        def load_model_hook(models, input_dir):
            load_model = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
            ema_model.load_state_dict(load_model.state_dict())
            ema_model.to(accelerator.device)
            del load_model
            for i in range(len(models)):
                # pop models so that they are not loaded again
                model = models.pop()
                # load diffusers style into model
                load_model = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
                model.register_to_config(**load_model.config)
                model.load_state_dict(load_model.state_dict())
                del load_model

        accelerator.register_save_state_pre_hook(save_model_hook)
        accelerator.register_load_state_pre_hook(load_model_hook)

    noise_scheduler = DDPMScheduler(num_train_timesteps=50)
    # --scale_lr
    learning_rate = (args.learning_rate * args.gradient_accumulation_steps * args.train_batch_size
                     * accelerator.num_processes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    train_dataloader = torch.utils.data.DataLoader(Images(), batch_size=args.train_batch_size, shuffle=True)
    max_train_steps = args.max_train_steps
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer=optimizer,
                                 num_warmup_steps=2 * accelerator.num_processes,
                                 num_training_steps=max_train_steps * accelerator.num_processes)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader,
                                                                           lr_scheduler)
    ema_model.to(accelerator.device)
    facts["lr"] = learning_rate
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    num_train_epochs = math.ceil(max_train_steps / num_update_steps_per_epoch)

    # We need to initialize the trackers we use, and also store our configuration.
    # The trackers initializes automatically on the main process.
    if accelerator.is_main_process:
        accelerator.init_trackers("train_shapes", config={"learning_rate": learning_rate, "resume": resume})

    global_step, first_epoch, resume_step = 0, 0, 0
    if resume:
        if args.resume_from_checkpoint != "latest":
            path = os.path.basename(args.resume_from_checkpoint)
        else:
            # Get the most recent checkpoint
            dirs = [d for d in os.listdir(args.output_dir) if d.startswith("checkpoint")]
            path = sorted(dirs, key=lambda x: int(x.split("-")[1]))[-1]
        accelerator.load_state(os.path.join(args.output_dir, path))
        global_step = int(path.split("-")[1])
        expected = torch.load(os.path.join(args.output_dir, f"expected-{global_step}.pt"))
        facts["resumed_from"] = path
        facts["ema_restored"] = torch.equal(flat(ema_model.shadow_params), expected["ema"])
        facts["model_restored"] = torch.equal(flat(accelerator.unwrap_model(model).parameters()), expected["model"])
        facts["ema_step_restored"] = ema_model.optimization_step == expected["ema_step"]
        resume_global_step = global_step * args.gradient_accumulation_steps
        first_epoch = global_step // num_update_steps_per_epoch
        resume_step = resume_global_step % (num_update_steps_per_epoch * args.gradient_accumulation_steps)
        facts.update(first_epoch=first_epoch, resume_step=resume_step)

    losses, saved, batches = [], [], []
    for epoch in range(first_epoch, num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            # Skip steps until we reach the resumed step
            if resume and epoch == first_epoch and step < resume_step:
                continue
            clean_images = batch["input"]
            batches.append(round(float(clean_images.double().sum()), 6))  # which samples this step trains on
            noise = torch.randn(clean_images.shape, device=clean_images.device)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean_images.shape[0],),
                                      device=clean_images.device).long()
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
            with accelerator.accumulate(model):
                model_output = model(noisy_images, timesteps).sample
                loss = F.mse_loss(model_output.float(), noise.float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            # Checks if the accelerator has performed an optimization step behind the scenes
            if accelerator.sync_gradients:
                ema_model.step(model.parameters())
                global_step += 1
                if accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:
                    if global_step % args.checkpointing_steps == 0:
                        # _before_ saving state, check if this save would set us over the `checkpoints_total_limit`
                        if args.checkpoints_total_limit is not None:
                            checkpoints = os.listdir(args.output_dir)
                            checkpoints = [d for d in checkpoints if d.startswith("checkpoint")]
                            checkpoints = sorted(checkpoints, key=lambda x: int(x.split("-")[1]))
                            # before we save the new checkpoint, we need to have at _most_ `checkpoints_total_limit - 1`
                            if len(checkpoints) >= args.checkpoints_total_limit:
                                num_to_remove = len(checkpoints) - args.checkpoints_total_limit + 1
                                for removing_checkpoint in checkpoints[0:num_to_remove]:
                                    shutil.rmtree(os.path.join(args.output_dir, removing_checkpoint))
                        save_path = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                        accelerator.save_state(save_path)
                        logger.info(f"Saved state to {save_path}")
                        saved.append(global_step)
                        torch.save({"ema": flat(ema_model.shadow_params), "ema_step": ema_model.optimization_step,
                                    "model": flat(accelerator.unwrap_model(model).parameters())},
                                   os.path.join(args.output_dir, f"expected-{global_step}.pt"))

            logs = {"loss": loss.detach().item(), "lr": lr_scheduler.get_last_lr()[0], "step": global_step,
                    "ema_decay": ema_model.cur_decay_value}
            accelerator.log(logs, step=global_step)
            losses.append(round(loss.detach().item(), 6))
            if global_step >= max_train_steps:
                break
        if global_step >= max_train_steps:
            break

    accelerator.wait_for_everyone()
    # Generate sample images for visual inspection (the validation of train_unconditional.py, on the main process)
    if accelerator.is_main_process:
        unet = accelerator.unwrap_model(model)
        before = flat(unet.parameters())
        ema_model.store(unet.parameters())
        ema_model.copy_to(unet.parameters())
        with torch.no_grad():
            sample = unet(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)), 10).sample
        ema_model.restore(unet.parameters())
        facts["validation_restored_weights"] = torch.equal(before, flat(unet.parameters()))
        images = ((sample.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
        tracker = accelerator.get_tracker("tensorboard", unwrap=True)
        tracker.add_images("test_samples", images, global_step)
        for tracker in accelerator.trackers:  # train_text_to_image.py's log_validation
            if tracker.name == "tensorboard":
                tracker.writer.add_images("validation", images.transpose(0, 2, 3, 1), global_step, dataformats="NHWC")
        facts["checkpoints"] = sorted(d for d in os.listdir(args.output_dir) if d.startswith("checkpoint"))
        last = os.path.join(args.output_dir, facts["checkpoints"][-1])
        facts["checkpoint_files"] = sorted(os.path.relpath(os.path.join(root, f), last)
                                           for root, _, files in os.walk(last) for f in files)
    facts.update(global_step=global_step, saved=saved, losses=losses, batches=batches,
                 trackers=[t.name for t in accelerator.trackers],
                 model=round(float(flat(accelerator.unwrap_model(model).parameters()).abs().sum()), 6),
                 ema=round(float(flat(ema_model.shadow_params).abs().sum()), 6),
                 weights=digest(accelerator.unwrap_model(model).parameters()), ema_weights=digest(ema_model.shadow_params),
                 optimizer_steps=sorted({int(st["step"]) for st in optimizer.state.values()}))
    accelerator.end_training()
    print("FACTS " + json.dumps(facts, sort_keys=True), flush=True)
    # the same in a file: the ranks' printed lines can interleave under a launcher
    with open(f"{args.output_dir}_facts_{run}_{accelerator.process_index}.json", "w") as fh:
        json.dump(facts, fh)


# (run, --output_dir suffix, --max_train_steps, --resume_from_checkpoint): one launch runs them all
RUNS = (("interrupted", "", 4, None), ("mid_epoch", "", 6, "latest"), ("boundary", "", 8, "latest"),
        ("uninterrupted", "_uninterrupted", 8, None))

if __name__ == "__main__":
    arguments = parse_args()
    for name, suffix, steps, resume_from in RUNS:
        main(argparse.Namespace(**{**vars(arguments), "output_dir": arguments.output_dir + suffix,
                                   "max_train_steps": steps, "resume_from_checkpoint": resume_from}), name)
