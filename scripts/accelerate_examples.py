"""Run Hugging Face Accelerate's example scripts on 2 CPU processes, offline: with anyaccel (import
lines swapped as ``sed s/accelerate/anyaccel/`` swaps them) and with Accelerate, and print a table.

Not part of CI: it needs a copy of Accelerate's repository (its ``examples/`` and the MRPC sample
under ``tests/test_samples/``), which the project never commits, and ``datasets`` (pip).

    python scripts/accelerate_examples.py --repo PATH [--rev REV] [--impl anyaccel accelerate]
                                          [--only NAME ...] [--timeout 900] [--json OUT]

``PATH`` is a checkout or a bare git directory (``--rev`` picks the commit, default ``HEAD``).
Everything the scripts would download is replaced, in every process they start, by an offline
stand-in made here (a ``sitecustomize`` on ``PYTHONPATH``):

* ``bert-base-cased`` and ``HuggingFaceTB/SmolLM-360M`` (``from_pretrained``) become tiny random
  models (BERT: 2 layers of width 32; Llama: 2 layers of width 32) with a word-level tokenizer
  built from the MRPC sample;
* ``load_dataset("nyu-mll/glue", "mrpc")`` reads Accelerate's MRPC sample (6 + 6 rows);
  ``evaluate.load("glue", "mrpc")`` is a small accuracy/F1 metric;
* ``timm.create_model`` is a small CNN with ``default_cfg``, ``torchvision.transforms`` the four
  transforms the cv examples use (drawn from torch's RNG, as torchvision's), and the cv examples'
  ``--data_dir`` a folder of 24 small JPEGs in 3 classes.

Scripts run as Accelerate's own test suite runs them (``TESTING_MOCKED_DATALOADERS=1``, the same
arguments as its ``tests/test_examples.py``). anyaccel's side is ``anyaccel launch
--num_processes 2 --cpu``; Accelerate's is ``torchrun --nproc_per_node 2`` with
``ACCELERATE_USE_CPU=1`` (``accelerate launch --cpu --num_processes 2`` starts one process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from accelerate_compat.worker import sed_imports  # noqa: E402  (the one import-swap rule)

# name -> (path in the repository, arguments, extra environment). {tmp} is a fresh directory,
# {data} the image folder. Arguments as Accelerate's tests/test_examples.py passes them.
EXAMPLES: Dict[str, Tuple[str, List[str], Dict[str, str]]] = {
    "nlp_example": ("examples/nlp_example.py", ["--cpu"], {}),
    "complete_nlp_example": ("examples/complete_nlp_example.py",
                             ["--cpu", "--checkpointing_steps", "epoch", "--output_dir", "{tmp}"], {}),
    "cv_example": ("examples/cv_example.py", ["--cpu", "--data_dir", "{data}"], {}),
    "complete_cv_example": ("examples/complete_cv_example.py",
                            ["--cpu", "--data_dir", "{data}", "--checkpointing_steps", "epoch", "--output_dir",
                             "{tmp}"], {}),
    "automatic_gradient_accumulation": ("examples/by_feature/automatic_gradient_accumulation.py", [], {}),
    "checkpointing": ("examples/by_feature/checkpointing.py",
                      ["--checkpointing_steps", "epoch", "--output_dir", "{tmp}"], {}),
    "cross_validation": ("examples/by_feature/cross_validation.py", ["--num_folds", "2"],
                         {"TESTING_MOCKED_DATALOADERS": "0"}),
    "ddp_comm_hook": ("examples/by_feature/ddp_comm_hook.py", ["--ddp_comm_hook", "fp16"], {}),
    "early_stopping": ("examples/by_feature/early_stopping.py", [], {}),
    "fsdp_with_peak_mem_tracking": ("examples/by_feature/fsdp_with_peak_mem_tracking.py",
                                    ["--model_name_or_path", "bert-base-cased", "--output_dir", "{tmp}",
                                     "--checkpointing_steps", "1"], {}),
    "gradient_accumulation": ("examples/by_feature/gradient_accumulation.py", [], {}),
    "gradient_accumulation_for_autoregressive_models": (
        "examples/by_feature/gradient_accumulation_for_autoregressive_models.py", ["--gradient_accumulation_steps", "2"],
        {}),
    "local_sgd": ("examples/by_feature/local_sgd.py", [], {}),
    "memory": ("examples/by_feature/memory.py", [], {}),
    "multi_process_metrics": ("examples/by_feature/multi_process_metrics.py", [], {}),
    "profiler": ("examples/by_feature/profiler.py", [], {}),
    "schedule_free": ("examples/by_feature/schedule_free.py", [], {}),
    "tracking": ("examples/by_feature/tracking.py", ["--with_tracking", "--project_dir", "{tmp}"],
                 # mlflow 3's default sqlite store needs sqlalchemy, absent here: its file store
                 {"MLFLOW_TRACKING_URI": "file:{tmp}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"}),
}
# what cannot run on this machine whatever the library, and why
CANNOT_RUN = {
    "deepspeed_with_config_support": "DeepSpeed plus a Hub model and dataset named on the command line",
    "megatron_lm_gpt_pretraining": "Megatron-LM (GPUs) plus a Hub model and dataset",
    "finetune_lm_tpu": "torch_xla on a TPU, peft, trl, a Hub model and the dolly dataset",
    "multigpu_remote_launcher": "runhouse and a cloud cluster",
}

SITECUSTOMIZE = r'''
"""Offline stand-ins for what Accelerate's examples download (scripts/accelerate_examples.py)."""
import importlib.abc, importlib.machinery, os, sys

_MODELS = {"bert-base-cased": os.environ["EXAMPLES_TINY_BERT"], "HuggingFaceTB/SmolLM-360M": os.environ["EXAMPLES_TINY_LM"]}
_MRPC = os.environ["EXAMPLES_MRPC"]


def _patch_auto(names):
    def patch(module):
        for name in names:
            _patch_class(getattr(module, name))
    return patch


def _patch_class(cls):
    if True:
        original = cls.from_pretrained

        def from_pretrained(name_or_path, *args, _original=original, **kwargs):
            return _original(_MODELS.get(str(name_or_path), name_or_path), *args, **kwargs)

        cls.from_pretrained = staticmethod(from_pretrained)


def _patch_datasets(module):
    original = module.load_dataset

    def load_dataset(path, *args, **kwargs):
        if path in ("glue", "nyu-mll/glue") and (args[:1] == ("mrpc",) or kwargs.get("name") == "mrpc"):
            import csv
            labels = {"not_equivalent": 0, "equivalent": 1}
            splits = {}
            for split, name in (("train", "train.csv"), ("validation", "dev.csv"), ("test", "dev.csv")):
                with open(os.path.join(_MRPC, name)) as f:
                    rows = list(csv.DictReader(f))
                import pyarrow
                table = pyarrow.table({
                    "sentence1": [r["sentence1"] for r in rows], "sentence2": [r["sentence2"] for r in rows],
                    "label": [labels[r["label"]] for r in rows], "idx": list(range(len(rows)))})
                splits[split] = module.Dataset(table, fingerprint=f"mrpc-sample-{split}")
            return module.DatasetDict(splits)
        return original(path, *args, **kwargs)

    module.load_dataset = load_dataset


class _Finder(importlib.abc.MetaPathFinder):
    """Patch transformers / datasets right after they are imported (nothing is imported early)."""
    patches = {"transformers.models.auto.tokenization_auto": _patch_auto(["AutoTokenizer"]),
               "transformers.models.auto.configuration_auto": _patch_auto(["AutoConfig"]),
               "transformers.models.auto.modeling_auto": _patch_auto(
                   ["AutoModel", "AutoModelForSequenceClassification", "AutoModelForCausalLM"]),
               "datasets": _patch_datasets}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, self.patches[fullname]

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = Loader()
        return spec


sys.meta_path.insert(0, _Finder())
for _extra in os.environ.get("EXAMPLES_EXTRA_PATH", "").split(os.pathsep):
    if _extra and _extra not in sys.path:
        sys.path.append(_extra)  # after site-packages: only what the virtual environment lacks
'''

EVALUATE = r'''
"""``evaluate.load("glue", "mrpc")`` offline: accuracy and F1 of the positive class."""


class _Metric:
    def __init__(self):
        self.predictions, self.references = [], []

    def add_batch(self, predictions=None, references=None):
        self.predictions += [int(p) for p in predictions]
        self.references += [int(r) for r in references]

    def compute(self, predictions=None, references=None):
        if predictions is not None:
            self.add_batch(predictions, references)
        pairs = list(zip(self.predictions, self.references))
        self.predictions, self.references = [], []
        tp = sum(1 for p, r in pairs if p == r == 1)
        fp = sum(1 for p, r in pairs if p == 1 and r == 0)
        fn = sum(1 for p, r in pairs if p == 0 and r == 1)
        accuracy = sum(1 for p, r in pairs if p == r) / max(len(pairs), 1)
        return {"accuracy": accuracy, "f1": 2 * tp / max(2 * tp + fp + fn, 1)}


def load(*args, **kwargs):
    return _Metric()
'''

TIMM = r'''
"""``timm.create_model`` offline: a small CNN with timm's ``default_cfg`` and ``get_classifier``."""
import torch


class _Net(torch.nn.Module):
    default_cfg = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}

    def __init__(self, num_classes):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 5, stride=4), torch.nn.BatchNorm2d(8),
                                            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.fc = torch.nn.Linear(8, num_classes)

    def get_classifier(self):
        return self.fc

    def forward(self, x):
        return self.fc(self.features(x))


def create_model(name, pretrained=False, num_classes=1000, **kwargs):
    return _Net(num_classes)
'''

TRANSFORMS = r'''
"""The torchvision transforms the cv examples use, offline (random draws from torch's RNG)."""
import math

import numpy as np
import torch


def _size(size):
    return (size, size) if isinstance(size, int) else tuple(size)


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, image):
        for t in self.transforms:
            image = t(image)
        return image


class Resize:
    def __init__(self, size):
        self.size = _size(size)

    def __call__(self, image):
        return image.resize(self.size[::-1])


class RandomResizedCrop:
    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = _size(size), scale, ratio

    def __call__(self, image):
        width, height = image.size
        area = width * height
        for _ in range(10):
            target = area * torch.empty(1).uniform_(*self.scale).item()
            log_ratio = torch.log(torch.tensor(self.ratio))
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = torch.randint(0, height - h + 1, size=(1,)).item()
                left = torch.randint(0, width - w + 1, size=(1,)).item()
                return image.crop((left, top, left + w, top + h)).resize(self.size[::-1])
        return image.resize(self.size[::-1])


class ToTensor:
    def __call__(self, image):
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()
'''


def extract(repo: str, rev: str, into: Path) -> Path:
    """``examples/`` and ``tests/test_samples/`` of ``repo`` at ``rev`` under ``into``."""
    if (Path(repo) / "examples").is_dir():
        for part in ("examples", "tests/test_samples"):
            shutil.copytree(Path(repo) / part, into / part)
        return into
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "--git-dir", repo, "archive", rev, "examples", "tests/test_samples"], stdout=f,
                       check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    archive.unlink()
    return into


def tiny_models(into: Path, mrpc: Path) -> Tuple[Path, Path]:
    """A tiny BERT classifier and a tiny Llama, with word-level tokenizers over the MRPC sample."""
    import csv

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (BertConfig, BertForSequenceClassification, BertTokenizerFast, LlamaConfig,
                              LlamaForCausalLM, PreTrainedTokenizerFast)

    words = set()
    for name in ("train.csv", "dev.csv"):
        with open(mrpc / name) as f:
            for row in csv.DictReader(f):
                words.update((row["sentence1"] + " " + row["sentence2"]).split())
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = specials + sorted(words)
    bert = into / "tiny-bert"
    bert.mkdir()
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=False,
                      model_max_length=64).save_pretrained(bert)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertForSequenceClassification(config).save_pretrained(bert)
    lm = into / "tiny-lm"
    lm.mkdir()
    lm_vocab = {w: i for i, w in enumerate(["<unk>", "</s>"] + sorted(words))}
    word_level = Tokenizer(models.WordLevel(lm_vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="</s>", unk_token="<unk>",
                            model_max_length=64).save_pretrained(lm)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(lm_vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                 eos_token_id=1, pad_token_id=1, bos_token_id=1)).save_pretrained(lm)
    return bert, lm


def images(into: Path) -> Path:
    """24 small JPEGs named ``<label>_<n>.jpg`` in 3 classes (the pets layout of the cv examples)."""
    import numpy as np
    from PIL import Image

    folder = into / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for c, label in enumerate(("beagle", "persian", "pug")):
        for n in range(8):
            pixels = (rng.random((48, 64, 3)) * 80 + 60 * c).clip(0, 255).astype("uint8")
            Image.fromarray(pixels).save(folder / f"{label}_{n}.jpg")
    return folder


def shim(into: Path) -> Path:
    """The directory put first on ``PYTHONPATH``: sitecustomize, and the modules this machine lacks."""
    import importlib.util

    folder = into / "shim"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if importlib.util.find_spec("evaluate") is None:
        (folder / "evaluate").mkdir()
        (folder / "evaluate" / "__init__.py").write_text(EVALUATE)
    return folder


def cv_shim(into: Path) -> Path:
    """timm and torchvision stand-ins, on ``PYTHONPATH`` for the cv examples only (transformers
    would take the stand-in torchvision for the real one)."""
    import importlib.util

    folder = into / "shim-cv"
    folder.mkdir()
    if importlib.util.find_spec("timm") is None:
        (folder / "timm").mkdir()
        (folder / "timm" / "__init__.py").write_text(TIMM)
    if importlib.util.find_spec("torchvision") is None:
        (folder / "torchvision" / "transforms").mkdir(parents=True)
        (folder / "torchvision" / "__init__.py").write_text("import PIL.Image  # as torchvision's import does\n")
        (folder / "torchvision" / "transforms" / "__init__.py").write_text(TRANSFORMS)
    return folder


def run_one(impl: str, name: str, src: Path, env: Dict[str, str], data: Path, timeout: float) -> Dict[str, object]:
    relpath, args, extra = EXAMPLES[name]
    script = src / relpath
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=src))
    if impl == "anyaccel":
        swapped = script.with_name(script.stem + "_anyaccel.py")
        swapped.write_text(sed_imports(script.read_text()))
        script = swapped
        command = [sys.executable, "-m", "anyaccel.cli", "launch", "--num_processes", "2", "--cpu", str(script)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    command += [a.format(tmp=tmp, data=data) for a in args]
    run_env = dict(env, **{k: v.format(tmp=tmp) for k, v in extra.items()})
    if env["TESTING_MOCKED_DATALOADERS"] != "1":
        run_env["TESTING_MOCKED_DATALOADERS"] = "0"
    if "{data}" in args:  # the cv examples
        run_env["PYTHONPATH"] = os.pathsep.join([env["EXAMPLES_CV_SHIM"], env["PYTHONPATH"]])
    if impl == "accelerate":
        run_env["ACCELERATE_USE_CPU"] = "1"
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=src, env=run_env, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = None, (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    seconds = round(time.monotonic() - start, 1)
    (src / f"{impl}-{name}.log").write_text(out)
    lines = [line for line in out.splitlines() if line.strip()]
    error = next((line for line in reversed(lines) if "Error" in line or "error:" in line), lines[-1] if lines else "")
    if rc == 0:
        outcome = "trained"
    elif rc is None:
        outcome = f"timeout after {timeout:.0f} s"
    elif "ModuleNotFoundError" in out or "ImportError" in out and "Traceback" in out:
        outcome = "does not start"
    else:
        outcome = "starts, fails"
    epochs = sum(1 for line in lines if line.lstrip().startswith("epoch ") or "epoch " in line.split(":")[0])
    return {"outcome": outcome, "rc": rc, "seconds": seconds, "error": "" if rc == 0 else error[:240],
            "epoch_lines": epochs}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="Accelerate's repository: a checkout or a (bare) git directory")
    parser.add_argument("--rev", default="HEAD", help="the commit to take examples from (git directory only)")
    parser.add_argument("--impl", nargs="+", choices=("anyaccel", "accelerate"), default=["anyaccel", "accelerate"])
    parser.add_argument("--only", nargs="+", choices=sorted(EXAMPLES), help="run only these examples")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--extra-path", default="", help="a folder of packages the environment lacks (datasets...)")
    parser.add_argument("--anyaccel-root", default=str(ROOT),
                        help="the folder holding the anyaccel package to test (default: this checkout)")
    parser.add_argument("--no-mocked", action="store_true",
                        help="TESTING_MOCKED_DATALOADERS=0: the scripts' own loaders (GLUE MRPC: the sample here)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs: <impl>-<name>.log)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="accelerate-examples-"))
    src = extract(args.repo, args.rev, work / "src")
    mrpc = src / "tests" / "test_samples" / "MRPC"
    bert, lm = tiny_models(work, mrpc)
    data = images(work)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(shim(work)), args.anyaccel_root]), EXAMPLES_TINY_BERT=str(bert),
               EXAMPLES_TINY_LM=str(lm), EXAMPLES_MRPC=str(mrpc), EXAMPLES_EXTRA_PATH=args.extra_path,
               TESTING_MOCKED_DATALOADERS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               EXAMPLES_CV_SHIM=str(cv_shim(work)), HF_HOME=str(work / "hf"), WANDB_MODE="offline", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if args.no_mocked:
        env["TESTING_MOCKED_DATALOADERS"] = "0"
    results: Dict[str, Dict[str, object]] = {}
    for name in args.only or EXAMPLES:
        for impl in args.impl:
            res = run_one(impl, name, src, env, data, args.timeout)
            results.setdefault(name, {})[impl] = res
            print(f"{name:48} {impl:10} {res['outcome']:16} {res['seconds']:7.1f} s  {res['error']}", flush=True)
    print("\n| example | " + " | ".join(args.impl) + " |\n|---|" + "---|" * len(args.impl))
    for name, by_impl in results.items():
        cells = [f"{r['outcome']}" + (f": {r['error'][:90]}" if r["error"] else "") for r in by_impl.values()]
        print(f"| `{name}` | " + " | ".join(cells) + " |")
    for name, why in CANNOT_RUN.items():
        print(f"| `{name}` | " + " | ".join(f"cannot run here: {why}" for _ in args.impl) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rev": args.rev, "results": results, "cannot_run": CANNOT_RUN},
                                              indent=1))
    if args.keep:
        print(f"\nwork folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
