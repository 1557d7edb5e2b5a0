"""Linear probe and few-shot classification on image features, with CLIP_benchmark 1.6's protocol
(`clip_benchmark/metrics/linear_probe.py` and the split its CLI makes).

The protocol, step by step, all randomness drawn from `seed`:

1. features are L2-normalised (`normalize`, CLIP_benchmark's default);
2. with `val_proportion`, the train split is cut into train and validation parts by `torch.utils.data.random_split`
   (CLIP_benchmark's `--val_proportion`); alternatively a validation split is given (its `--val_split`);
3. the train part is shuffled by `torch.randperm` and, with `fewshot_k > 0`, the first `fewshot_k` samples of each
   class in that order are kept;
4. a linear layer (`torch.nn.Linear`, its default initialisation) is trained with AdamW, cross-entropy, a cosine
   learning-rate schedule without warm-up over every step, `epochs` epochs of shuffled batches;
5. with a validation set, the weight decay is chosen on it: CLIP_benchmark's grid of 97 values from 1e-6 to 1e2
   (12 per decade), first every 16th value, then around the best one at 8, 4, 2, 1 grid steps; the best is the
   first with the highest top-1 accuracy. Without one, the weight decay is 0 (CLIP_benchmark's default, no sweep);
6. the final layer is trained with that weight decay on train + validation (full data) or on the few-shot samples
   alone (few-shot: adding the validation set would give more shots than asked), and evaluated on the test split:
   acc1, acc5 (NaN when the test labels stay below 5) and the mean per-class recall.

On N ranks (a process group: the suite on N ranks) the sweep's candidates of each step are trained on different ranks
and their scores gathered (`choose_weight_decay`'s `score_all`), a round that would leave ranks idle training ahead
the candidates of the next steps, then the final fit of the peak so far (`weight_decay_sweep`); a training is
deterministic, so the choice and the numbers are the one rank's. The layer trains on `device` (the suite passes the
model's: a GPU where there is one), the features moved there once and each batch indexed there, in the order
CLIP_benchmark's DataLoader draws.

The seed is applied as CLIP_benchmark's CLI applies it: `torch.manual_seed(seed)` before the split and the few-shot
draw, and again before each training. Its CLI also builds the model between its seed and its split, which draws from
the same generator, so equal seeds give the same protocol but not the CLI's own split; on features it is handed
(its feature cache), CLIP_benchmark's `evaluate` gives the same numbers as this function. The caller's global torch
random state is left as it was.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, random_split

from disco_clip_ds.distributed.ranks import world_size
from disco_clip_ds.errors import UsageError
from disco_clip_ds.eval.spread import across_ranks

# CLIP_benchmark's CLI defaults (--batch_size, --fewshot_epochs, --fewshot_lr, --seed, --normalize, --fewshot_k)
BATCH_SIZE = 64
EPOCHS = 10
LR = 0.1
SEED = 0
# CLIP_benchmark's metric names for a linear-probe task in its result JSON
CLIP_BENCHMARK_NAMES = {"acc1": "lp_acc1", "acc5": "lp_acc5", "mean_per_class_recall": "lp_mean_per_class_recall"}


def weight_decay_grid() -> tuple[list[float], list[int]]:
    """CLIP_benchmark's weight-decay grid (97 log-spaced values, 1e-6 to 1e2) and the indices it tries first: those
    equal to one of 7 log-spaced values over the same range (found by float equality, as there)."""
    grid = np.logspace(-6, 2, num=97).tolist()
    coarse = set(np.logspace(-6, 2, num=7).tolist())
    return grid, [i for i, wd in enumerate(grid) if wd in coarse]


def linear_probe(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    *,
    fewshot_k: int = -1,
    seed: int = SEED,
    batch_size: int = BATCH_SIZE,
    epochs: int = EPOCHS,
    lr: float = LR,
    weight_decays: Sequence[float] | None = None,
    val_proportion: float | None = None,
    val_features: torch.Tensor | None = None,
    val_labels: torch.Tensor | None = None,
    normalize: bool = True,
    amp: bool = True,
    device: str | torch.device = "cpu",
) -> dict:
    """Train a linear classifier on `train_features` (n, d) with integer `train_labels` (n,), evaluate it on the
    test split; the protocol is the module's (CLIP_benchmark's). Returns acc1, acc5, mean_per_class_recall and the
    weight_decay used, n_train (the samples the final layer was trained on) and the settings that made them
    (fewshot_k, epochs, seed, normalized).

    fewshot_k: samples per class for training (-1: all). val_proportion / val_features + val_labels: a validation
    set on which to choose the weight decay (none: weight decay 0, as in CLIP_benchmark). weight_decays: the
    candidates to try one by one instead of CLIP_benchmark's grid search. amp: float16 autocast on CUDA, as
    CLIP_benchmark (it has no effect on CPU, there or here).
    """
    train = _checked_split("train", train_features, train_labels)
    test = _checked_split("test", test_features, test_labels)
    val = None if val_features is None and val_labels is None else _checked_split("val", val_features, val_labels)
    _check_settings(fewshot_k, batch_size, epochs, lr, val_proportion, val, weight_decays)
    _check_dims(train, test, val)
    train, test = _prepared(train, normalize), _prepared(test, normalize)
    val = None if val is None else _prepared(val, normalize)

    generator = torch.Generator().manual_seed(seed)
    if val_proportion is not None:
        train, val = _split_off_validation(train, val_proportion, generator)
    n_classes = int(train[1].max()) + 1  # CLIP_benchmark sizes the layer by the train part's labels
    where = "the train part left by val_proportion" if val_proportion is not None else "the train split"
    _check_labels_seen(train[1], where, test=test, val=val)
    if fewshot_k > 0:
        _check_fewshot_counts(train[1], fewshot_k, where)
    chosen = fewshot_indices(train[1], fewshot_k, torch.randperm(len(train[1]), generator=generator))
    shots = (train[0][chosen], train[1][chosen])

    fit = _Trainer(n_classes, seed=seed, batch_size=batch_size, epochs=epochs, lr=lr, amp=amp, device=device)
    final_data = shots if fewshot_k > 0 or val is None else _concat(shots, val)

    def final(weight_decay: float) -> torch.Tensor:
        return fit.logits(fit.train(final_data, weight_decay), test[0])

    with torch.random.fork_rng(devices=[]):  # the trainings reseed torch's global generator; the caller keeps theirs
        weight_decay, logits = 0.0, None
        if val is not None:
            score = functools.partial(fit.val_acc1, shots, val)
            found = weight_decay_sweep(score, weight_decays, in_turn(), slots=world_size(), final=final)
            weight_decay, logits = found.weight_decay, found.finals.get(found.weight_decay)
        if logits is None:  # not trained ahead in a sweep's spare slot
            logits = final(weight_decay)
    metrics = classification_metrics_topk(logits, test[1])
    settings = {"fewshot_k": fewshot_k, "epochs": epochs, "seed": seed, "normalized": normalize}
    return {**metrics, "weight_decay": weight_decay, "n_train": len(final_data[1]), **settings}


def fewshot_indices(labels: torch.Tensor, fewshot_k: int, order: torch.Tensor) -> list[int]:
    """Indices of `labels` in `order`, keeping the first `fewshot_k` of each class (all of them when negative)."""
    counts: dict[int, int] = {}
    chosen = []
    labels = labels.tolist()  # a Python list: indexing a tensor per sample would dominate on a large train split
    for index in order.tolist():
        label = labels[index]
        if fewshot_k < 0 or counts.get(label, 0) < fewshot_k:
            counts[label] = counts.get(label, 0) + 1
            chosen.append(index)
    return chosen


def choose_weight_decay(
    val_acc1: Callable[[float], float],
    weight_decays: Sequence[float] | None = None,
    score_all: Callable[[Callable, list], list] | None = None,
    slots: int = 1,
) -> float:
    """The weight decay whose layer scores the best validation top-1 (`val_acc1`), the first one on ties.

    Without `weight_decays`, CLIP_benchmark's search over its grid (see `weight_decay_grid`); with them, each one
    is tried. As there, the first candidate of the list stands unless another scores above 0. `score_all(val_acc1,
    candidates)`: their scores in order, however computed (`across_ranks`: the candidates of a step split across
    ranks); default one after the other. `slots`: how many candidates `score_all` trains at once (the ranks): the
    first grid points go in rounds of that many, and a round with fewer new candidates fills the rest with those the
    next steps ask for if the peak so far stands. A training is deterministic, so a candidate trained ahead scores
    what it would at its own step: the choice is the same for any `slots`, in fewer rounds."""
    return weight_decay_sweep(val_acc1, weight_decays, score_all, slots).weight_decay


@dataclass
class Sweep:
    """What `weight_decay_sweep` found: the weight decay, and `final(weight decay)` for those it trained ahead."""

    weight_decay: float
    finals: dict


@dataclass(frozen=True)
class _Final:
    weight_decay: float


def weight_decay_sweep(val_acc1, weight_decays=None, score_all=None, slots: int = 1, final=None) -> Sweep:
    """`choose_weight_decay`'s search; with `final` (the final fit of a weight decay), a round's slots left after its
    candidates and those trained ahead take `final(the peak so far)`: the last steps rarely move the peak, and the
    final fit then costs no round of its own."""
    grid, first = (list(weight_decays), list(range(len(weight_decays)))) if weight_decays else weight_decay_grid()
    score_all = score_all or (lambda score, values: [score(value) for value in values])
    scores: dict[int, float] = {}  # training is deterministic: a candidate tried twice gives the same score
    finals: dict[float, object] = {}

    def job(value):
        return final(value.weight_decay) if isinstance(value, _Final) else val_acc1(value)

    def peak_of(indices) -> int:
        best_index, best_acc = 0, 0.0
        for i in indices:
            if scores[i] > best_acc:
                best_index, best_acc = i, scores[i]
        return best_index

    def train(new: list[int], ahead=(), guess: int | None = None) -> None:
        spare = [i for i in dict.fromkeys(ahead) if i not in scores and i not in new][: -len(new) % slots]
        values = [grid[i] for i in new + spare]
        if final is not None and guess is not None and len(values) % slots and grid[guess] not in finals:
            values.append(_Final(grid[guess]))  # a slot still free: the final fit, if the peak so far stands
        results = score_all(job, values)
        for value, result in zip(values, results):
            if isinstance(value, _Final):
                finals[value.weight_decay] = result
        scores.update(zip(new + spare, results))

    def best(indices, ahead=(), guess=None) -> int:
        new = [i for i in dict.fromkeys(indices) if i not in scores]  # a step's untried candidates, trained together
        if new:
            train(new, ahead, guess)
        return peak_of(indices)

    span = 8 if not weight_decays else 0  # the refinement only applies to CLIP_benchmark's grid
    full = len(first) - len(first) % slots if len(first) > slots else 0
    guess = None
    if full:  # whole rounds first; the last, short one fills up around their peak
        train(first[:full])
        guess = peak_of(first[:full])
    peak = best(first, _around(guess, span, len(grid)) if full else (), guess)
    while span > 0:
        steps = _around(peak, span // 2, len(grid))
        peak = best([max(peak - span, 0), peak, min(peak + span, len(grid) - 1)], steps, peak)
        span //= 2
    return Sweep(grid[peak], finals)


def _around(peak: int, span: int, size: int) -> list[int]:
    """The candidates the refinement steps from `span` down ask for if `peak` stands (within the grid's `size`)."""
    return [min(max(peak + sign * s, 0), size - 1) for s in _halvings(span) for sign in (-1, 1)]


def _halvings(span: int) -> list[int]:
    """span, span // 2, ..., 1 (none for 0)."""
    return [span >> k for k in range(span.bit_length())]


def in_turn() -> Callable[[Callable, list], list]:
    """A `score_all` that trains each step's candidates across ranks (eval/spread.py's `across_ranks`), dealing on
    from the rank after the last one used: a step with one new candidate (the peak at the grid's edge) goes to the
    next rank, not always to rank 0."""
    dealt = 0

    def score_all(score: Callable, values: list) -> list:
        nonlocal dealt
        scores = across_ranks(score, values, first=dealt % world_size())
        dealt += len(values)
        return scores

    return score_all


def classification_metrics_topk(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """acc1, acc5 and mean per-class recall as CLIP_benchmark's linear probe computes them: hits among the indices
    `torch.topk` returns (ties broken as it breaks them), acc5 only when some test label is 5 or more, the recall
    from the argmax."""
    from sklearn.metrics import balanced_accuracy_score

    predicted = logits.argmax(1)  # on the logits as computed (float16 under amp), as CLIP_benchmark takes it
    logits, targets = logits.float(), targets.long()
    ks = (1, 5) if int(targets.max()) >= 5 else (1,)
    top = logits.topk(max(ks), dim=1).indices
    hits = top == targets[:, None]
    metrics = {f"acc{k}": hits[:, :k].sum().item() / len(targets) for k in ks}
    metrics.setdefault("acc5", float("nan"))
    with warnings.catch_warnings():  # predicting a class absent from the test labels is normal here
        warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
        recall = balanced_accuracy_score(targets.numpy(), predicted.numpy())
    return {"acc1": metrics["acc1"], "acc5": metrics["acc5"], "mean_per_class_recall": float(recall)}


class _Trainer:
    """Trains and applies the linear layer with one set of hyperparameters (CLIP_benchmark's `train` / `infer`)."""

    def __init__(self, n_classes: int, *, seed: int, batch_size: int, epochs: int, lr: float, amp: bool, device):
        self.n_classes, self.seed, self.batch_size, self.epochs, self.lr = n_classes, seed, batch_size, epochs, lr
        self.device = torch.device(device)
        self.amp = amp and self.device.type == "cuda"  # CLIP_benchmark autocasts CUDA only; CPU math stays float32

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.float16) if self.amp else contextlib.nullcontext()

    def train(self, data: tuple[torch.Tensor, torch.Tensor], weight_decay: float) -> torch.nn.Linear:
        torch.manual_seed(self.seed)  # the same initial layer and batch order for every weight decay
        layer = torch.nn.Linear(data[0].shape[1], self.n_classes).to(self.device)
        optimizer = torch.optim.AdamW(layer.parameters(), lr=self.lr, weight_decay=weight_decay)
        features, labels = (t.to(self.device) for t in data)  # moved once; each batch is indexed where they are
        # CLIP_benchmark's DataLoader(TensorDataset, shuffle=True) draws its order from torch's global generator,
        # reseeded above: a loader over the sample indices draws the same, and yields the same batches
        loader = DataLoader(range(len(labels)), batch_size=self.batch_size, shuffle=True)
        total = self.epochs * len(loader)
        for step, rows in enumerate(batch for _ in range(self.epochs) for batch in loader):
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(self.lr, step, total)
            rows = rows.to(self.device)
            optimizer.zero_grad()
            with self._autocast():
                loss = F.cross_entropy(layer(features[rows]), labels[rows])
            loss.backward()
            optimizer.step()
        return layer

    @torch.no_grad()
    def logits(self, layer: torch.nn.Linear, features: torch.Tensor) -> torch.Tensor:
        features, outputs = features.to(self.device), []
        for start in range(0, len(features), self.batch_size):  # CLIP_benchmark's inference batches
            with self._autocast():
                outputs.append(layer(features[start : start + self.batch_size]))
        return torch.cat(outputs).cpu()

    def val_acc1(self, shots, val, weight_decay: float) -> float:
        logits = self.logits(self.train(shots, weight_decay), val[0]).float()
        return (logits.topk(1, dim=1).indices[:, 0] == val[1]).sum().item() / len(val[1])


def cosine_lr(base_lr: float, step: int, total: int) -> float:
    """The learning rate at `step` of `total`: a half cosine from `base_lr` to 0, no warm-up (CLIP_benchmark's)."""
    return 0.5 * (1 + np.cos(np.pi * step / total)) * base_lr


def _checked_split(name: str, features, labels) -> tuple[torch.Tensor, torch.Tensor]:
    if features is None or labels is None:
        raise UsageError(f"the {name} split needs both features and labels")
    features, labels = torch.as_tensor(features), torch.as_tensor(labels)
    if features.ndim != 2 or len(features) == 0:
        raise UsageError(f"{name} features must be a non-empty (samples, dim) matrix; shape {tuple(features.shape)}")
    if labels.ndim != 1 or len(labels) != len(features):
        raise UsageError(
            f"{name} labels must be one per feature row: {len(features)} rows, labels of shape {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise UsageError(f"{name} labels must be integer class ids, got {labels.dtype}")
    if int(labels.min()) < 0:
        raise UsageError(f"{name} labels must be class ids from 0, got {int(labels.min())}")
    return features, labels.long()


def _check_settings(fewshot_k, batch_size, epochs, lr, val_proportion, val, weight_decays) -> None:
    if fewshot_k == 0 or fewshot_k < -1:
        raise UsageError(f"fewshot_k must be a number of samples per class, or -1 for all; got {fewshot_k}")
    if batch_size < 1 or epochs < 1 or not lr > 0:
        raise UsageError(f"batch_size and epochs must be >= 1 and lr > 0; got {batch_size}, {epochs}, {lr}")
    if val_proportion is not None and val is not None:
        raise UsageError("give a validation split or a val_proportion of the train split, not both")
    if val_proportion is not None and not 0 < val_proportion < 1:
        raise UsageError(f"val_proportion must lie strictly between 0 and 1; got {val_proportion}")
    if weight_decays is not None and (len(weight_decays) == 0 or min(weight_decays) < 0):
        raise UsageError(f"weight_decays must be a non-empty list of values >= 0; got {list(weight_decays)}")


def _check_dims(train, test, val) -> None:
    for name, split in (("test", test), ("val", val)):
        if split is not None and split[0].shape[1] != train[0].shape[1]:
            raise UsageError(
                f"{name} features have dimension {split[0].shape[1]}, train features {train[0].shape[1]}: "
                "extract both with the same model"
            )


def _check_labels_seen(train_labels: torch.Tensor, where: str, **splits) -> None:
    """Every class of the test (and validation) labels has a sample in `train_labels`: the sets compared, not their
    largest labels, since a class missing in between is just as unlearnable."""
    seen = set(train_labels.unique().tolist())
    for name, split in splits.items():
        unseen = [] if split is None else sorted(set(split[1].unique().tolist()) - seen)
        if unseen:
            listed = ", ".join(map(str, unseen[:5])) + (" ..." if len(unseen) > 5 else "")
            raise UsageError(
                f"{name} labels include class {listed}, which no sample of {where} has ({len(unseen)} "
                f"class{'es' if len(unseen) > 1 else ''} unseen): the probe cannot predict a class it never saw; give "
                "every class train samples"
            )


def _check_fewshot_counts(labels: torch.Tensor, fewshot_k: int, where: str) -> None:
    counts = torch.bincount(labels)
    short = [(c, int(n)) for c, n in enumerate(counts.tolist()) if 0 < n < fewshot_k]
    if short:
        listed = ", ".join(f"class {c}: {n}" for c, n in short[:5]) + (" ..." if len(short) > 5 else "")
        raise UsageError(f"fewshot_k={fewshot_k} needs {fewshot_k} samples per class in {where}; {listed}")


def _prepared(split, normalize: bool):
    features = F.normalize(split[0], dim=-1) if normalize else split[0]
    return features.float(), split[1]


def _split_off_validation(train, val_proportion: float, generator: torch.Generator):
    n = len(train[1])
    train_part, val_part = random_split(range(n), [1 - val_proportion, val_proportion], generator=generator)
    if len(train_part) == 0 or len(val_part) == 0:
        raise UsageError(f"val_proportion={val_proportion} of {n} train samples leaves an empty part; change it")
    return _subset(train, train_part.indices), _subset(train, val_part.indices)


def _subset(split, indices):
    indices = torch.as_tensor(indices, dtype=torch.long)
    return split[0][indices], split[1][indices]


def _concat(a, b):
    return torch.cat((a[0], b[0])), torch.cat((a[1], b[1]))
