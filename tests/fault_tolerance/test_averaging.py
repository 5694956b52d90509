"""The overlapped, bucketed gradient average (anyaccel/fault_tolerance/averaging.py) with a stand-in
all-reduce (halves the tensor, records the order): buckets start in bucket order during backward,
a parameter no group had a gradient for is left without one, nothing is averaged when not armed;
and with two stand-in groups in two threads (:class:`_TwoGroups`, each all-reduce meeting the other
group's of the same rank in issue order): unused parameters as DDP's ``find_unused_parameters=True``,
a ``backward`` that raises after some buckets left, and gradient accumulation."""

from __future__ import annotations

import threading

import pytest
import torch

from anyaccel.fault_tolerance import averaging
from anyaccel.fault_tolerance.averaging import BucketedAverage


class _Done:
    def wait(self):
        return True


def _average(params, monkeypatch, bucket_bytes, first_bytes=None, find_unused=False):
    monkeypatch.setattr(averaging, "BUCKET_BYTES", bucket_bytes)
    monkeypatch.setattr(averaging, "FIRST_BUCKET_BYTES", bucket_bytes if first_bytes is None else first_bytes)
    started, quorums = [], []

    def allreduce(flat):
        started.append(flat.numel())
        flat.mul_(0.5)  # "the average of two groups, the other all zeros"
        return _Done()

    average = BucketedAverage(params, allreduce, lambda: quorums.append(1), find_unused_parameters=find_unused)
    return average, started, quorums


@pytest.mark.parametrize("find_unused", [False, True])
def test_buckets_start_in_order_during_backward_and_the_averages_land_in_the_gradients(monkeypatch, find_unused):
    """DDP's find_unused_parameters (default off): the unused parameter's zeros are averaged, and it
    is named in ``zeroed``; on, the flags follow the last bucket and it keeps .grad None."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    unused = torch.nn.Parameter(torch.ones(3))
    params = list(model.parameters()) + [unused]
    # closed once they hold 12 (the first) or 40 bytes: reversed, [unused (12)], [2.bias, 2.weight (8 + 64)],
    # [0.bias, 0.weight (32 + 128)]
    avg, started, quorums = _average(params, monkeypatch, bucket_bytes=40, first_bytes=12, find_unused=find_unused)
    assert avg.bucket_count == 3
    avg.arm()
    model(torch.ones(5, 4)).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert started == []  # the first bucket holds the unused parameter: nothing may start before it
    assert avg.finish() and not avg.aborted
    assert quorums == [1] and avg.zeroed == [unused]
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name] * 0.5)
    if find_unused:
        assert started == [3, 18, 40, 5 + 1]  # then the flags: one a parameter, and one more
        assert unused.grad is None  # no group had a gradient for it (here the other is all zeros): none, as DDP
    else:
        assert started == [3, 18, 40]  # no flags
        assert torch.equal(unused.grad, torch.zeros(3))


def test_a_bucket_starts_as_soon_as_it_and_the_ones_before_it_are_ready(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    # reversed: 1.bias (8 bytes), 1.weight (64), 0.bias (32), 0.weight (128); the first bucket is
    # closed at 72 bytes, the next ones at 32: [1.bias, 1.weight], [0.bias], [0.weight]
    avg, started, _ = _average(list(model.parameters()), monkeypatch, bucket_bytes=32, first_bytes=72)
    avg.arm()
    model(torch.ones(1, 4)).sum().backward()
    assert started == [18, 8, 32]  # all during backward (the last layer's gradients come first)
    avg.finish()
    # all three started during backward; the two-tensor bucket was copied to be flattened, the
    # one-gradient buckets were averaged in place
    assert avg.started_early == 3 and avg.early_bytes == (18 + 8 + 32) * 4 and avg.copied_bytes == 18 * 4


def test_buckets_are_cut_by_ddps_rule_so_a_model_of_a_few_mb_overlaps_backward():
    """The benchmark's MLP (5.3 MB of float32 gradients) was one 25 MiB bucket, started when backward
    ended (1.20x DDP's step); by DDP's rule (closed once at least 1 MiB, then 25 MiB) its last two
    layers are a bucket that starts while the first layer's gradients are computed."""
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 10))
    grads = list(reversed(list(mlp.parameters())))
    assert averaging.buckets_of(grads) == [[0, 1, 2, 3], [4, 5]]
    small, big = torch.zeros(10), torch.zeros(averaging.BUCKET_BYTES // 4)
    halves = torch.zeros(4, dtype=torch.float16)
    # the first closes once it holds 1 MiB, the second would at 25 MiB, a dtype change closes it
    assert averaging.buckets_of([small, small, big, small, big, small, halves, halves]) == [[0, 1, 2], [3, 4], [5], [6, 7]]


def test_gradients_side_by_side_in_one_storage_are_averaged_in_place_without_a_copy():
    from anyaccel.fault_tolerance.averaging import side_by_side

    flat = torch.arange(10.0)  # as FSDP2's reduce-scatter output: the unit's sharded gradients are views of it
    a, b = flat[:6].view(2, 3), flat[6:]
    span = side_by_side([b, a])  # bucket order is the reverse of the parameters'
    assert span is not None and span.numel() == 10 and span.data_ptr() == flat.data_ptr()
    span.mul_(2)
    assert torch.equal(a, torch.arange(6.0).view(2, 3) * 2) and torch.equal(b, torch.arange(6.0, 10.0) * 2)
    assert side_by_side([flat[:4], flat[5:]]) is None  # a gap (FSDP2's padding): flattened by a copy
    assert side_by_side([torch.ones(2), torch.ones(2)]) is None  # separate gradients (DDP, one process)
    assert side_by_side([flat[::2]]) is None  # not contiguous


def test_an_unarmed_backward_is_left_alone(monkeypatch):
    model = torch.nn.Linear(3, 1)
    avg, started, _ = _average(list(model.parameters()), monkeypatch, bucket_bytes=1024)
    model(torch.ones(2, 3)).sum().backward()
    assert not avg.finish() and started == []
    avg.close()


def test_a_parameter_tied_between_models_is_averaged_once_and_its_buckets_start_during_backward(monkeypatch):
    """A module shared by two prepared models is listed twice by the Accelerator: its parameters
    were hooked twice (each gradient counted twice, one bucket never ready during backward) and, each
    alone in a bucket, averaged twice in place (here 0.25 instead of 0.5)."""
    torch.manual_seed(0)
    shared, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    both = list(shared.parameters()) + list(head.parameters())
    head(shared(torch.ones(3, 4))).sum().backward()
    expected = [p.grad.clone() for p in both]
    for p in both:
        p.grad = None
    avg, started, _ = _average(both + list(shared.parameters()), monkeypatch, bucket_bytes=1)  # one gradient a bucket
    assert avg.bucket_count == 4
    avg.arm()
    head(shared(torch.ones(3, 4))).sum().backward()
    assert len(started) == 4  # every bucket during backward
    avg.finish()
    for p, grad in zip(both, expected):
        assert torch.equal(p.grad, grad * 0.5)


def _shared_twice(pre, shared, head, x, reentrant):
    from torch.utils.checkpoint import checkpoint

    x = checkpoint(shared, pre(x), use_reentrant=reentrant)
    return head(checkpoint(shared, torch.tanh(x), use_reentrant=reentrant)).sum()


def test_a_gradient_accumulated_again_after_its_bucket_left_is_an_error_not_a_partial_average(monkeypatch):
    """A module used in two reentrant checkpoint segments gets its gradient in two accumulations in
    one backward: its bucket started on the first part, and the average silently left out the second
    (DDP's reducer raises there too). Without reentrancy, or with the bucket still waiting for a
    gradient that comes later (``pre``'s), the average is exact."""
    import pytest

    from anyaccel.errors import FaultToleranceError

    torch.manual_seed(0)
    pre, shared, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    every = list(pre.parameters()) + list(shared.parameters()) + list(head.parameters())
    x = torch.ones(3, 4)
    _shared_twice(pre, shared, head, x, reentrant=False).backward()
    expected = [p.grad.clone() for p in every]
    for reentrant, bucket_bytes in ((False, 1), (True, 1024)):  # (1024: one bucket, which waits for pre's)
        for p in every:
            p.grad = None
        avg, _, _ = _average(every, monkeypatch, bucket_bytes)
        avg.arm()
        _shared_twice(pre, shared, head, x, reentrant).backward()
        avg.finish()
        avg.close()
        assert all(torch.allclose(p.grad, g * 0.5) for p, g in zip(every, expected)), reentrant
    for p in every:
        p.grad = None
    avg, _, _ = _average(every, monkeypatch, bucket_bytes=1)
    avg.arm()
    with pytest.raises(FaultToleranceError, match=r"shape \(4,\).*twice in one backward.*use_reentrant=False"):
        _shared_twice(pre, shared, head, x, reentrant=True).backward()


class _TwoGroups:
    """torchft's all-reduce between two replica groups, stood in for: each group's k-th all-reduce
    meets the other's k-th (the sizes must match: a desynchronised bucket order fails here) and
    ``wait()`` puts their average in it. ``sizes[g]``: what group ``g`` issued, in order."""

    def __init__(self):
        self.cond = threading.Condition()
        self.sent = ([], [])  # per group: (tensor, its value when it left)
        self.sizes = ([], [])

    def allreduce(self, group):
        def start(flat):
            with self.cond:
                self.sent[group].append((flat, flat.clone()))
                self.sizes[group].append(flat.numel())
                self.cond.notify_all()
            return _Meeting(self, group, len(self.sent[group]) - 1)

        return start


class _Meeting:
    def __init__(self, exchange, group, k):
        self.exchange, self.group, self.k = exchange, group, k

    def wait(self):
        ex = self.exchange
        with ex.cond:
            assert ex.cond.wait_for(lambda: len(ex.sent[1 - self.group]) > self.k, timeout=20), "the other group never sent"
            (flat, mine), (_, theirs) = ex.sent[self.group][self.k], ex.sent[1 - self.group][self.k]
            assert mine.numel() == theirs.numel(), f"all-reduce {self.k}: {mine.numel()} against {theirs.numel()}"
            flat.copy_((mine + theirs) / 2)
        return True


def _in_two_groups(step):
    """Run ``step(group)`` for groups 0 and 1 at once (two threads); re-raise what one raised."""
    errors = []

    def run(group):
        try:
            step(group)
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(g,)) for g in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


class _Three(torch.nn.Module):
    """``a`` used by every group, ``b`` by group 0 only, ``c`` by none."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, group):
        y = self.a(x)
        return (self.b(y) if group == 0 else y).sum()


def _two_groups(monkeypatch, bucket_bytes, make):
    """Two stand-in replica groups (:class:`_TwoGroups`) and a model of ``make()`` for each, alike
    (seed 0), with buckets closed at ``bucket_bytes``."""
    monkeypatch.setattr(averaging, "BUCKET_BYTES", bucket_bytes)
    monkeypatch.setattr(averaging, "FIRST_BUCKET_BYTES", bucket_bytes)
    models = []
    for _ in (0, 1):
        torch.manual_seed(0)
        models.append(make())
    return _TwoGroups(), models


@pytest.mark.parametrize("bucket_bytes", [1, 1024])  # one gradient a bucket; one bucket for all
def test_unused_parameters_are_averaged_as_ddp_with_find_unused_parameters(monkeypatch, bucket_bytes):
    """DDP with find_unused_parameters=True (torch 2.13, gloo, 2 ranks): a parameter one rank used
    receives the average with zeros from the other, one no rank used keeps .grad None (FSDP2 too).
    The average gave the unused parameter zeros, which an optimizer with weight decay or Adam's
    moments then moves."""
    exchange, models = _two_groups(monkeypatch, bucket_bytes, _Three)
    x = (torch.ones(2, 4), torch.full((2, 4), 2.0))
    own = []
    for g, m in enumerate(models):
        m(x[g], g).backward()
        own.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        m.zero_grad(set_to_none=True)
    averages = [BucketedAverage(list(m.parameters()), exchange.allreduce(g), lambda: None, find_unused_parameters=True)
                for g, m in enumerate(models)]

    def step(group):
        averages[group].arm()
        models[group](x[group], group).backward()
        assert averages[group].finish() and not averages[group].aborted

    _in_two_groups(step)
    assert exchange.sizes[0] == exchange.sizes[1]
    for m in models:
        grads = dict(m.named_parameters())
        for name in ("a.weight", "a.bias"):
            assert torch.allclose(grads[name].grad, (own[0][name] + own[1][name]) / 2)
        for name in ("b.weight", "b.bias"):
            assert torch.allclose(grads[name].grad, own[0][name] / 2)  # group 1's zeros in the average
        assert grads["c.weight"].grad is None and grads["c.bias"].grad is None


def _raising_below(module):
    """Make ``backward`` raise when it reaches ``module``'s output (its parameters' gradients and
    the ones before it in the graph are not computed)."""
    def forward_hook(_module, _inputs, output):
        def boom(_grad):
            raise ValueError("the loss's backward raised")
        output.register_hook(boom)

    return module.register_forward_hook(forward_hook)


def _two_groups_of_an_mlp(monkeypatch, find_unused):
    """Two stand-in groups of a Linear-Tanh-Linear, one gradient a bucket (4 all-reduces a step),
    their averages, inputs and each group's own gradients of one step: ``(exchange, models,
    averages, x, own)``."""
    exchange, models = _two_groups(monkeypatch, 1,
                                   lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)))
    averages = [BucketedAverage(list(m.parameters()), exchange.allreduce(g), lambda: None, find_unused_parameters=find_unused)
                for g, m in enumerate(models)]
    x = (torch.ones(2, 4), torch.full((2, 4), 2.0))
    own = []
    for g, m in enumerate(models):
        m(x[g]).sum().backward()
        own.append([p.grad.clone() for p in m.parameters()])
        m.zero_grad(set_to_none=True)
    return exchange, models, averages, x, own


@pytest.mark.parametrize("find_unused", [True, False])
def test_a_backward_that_raises_after_buckets_left_sends_the_rest_and_the_next_steps_line_up(monkeypatch, find_unused):
    """Group 1's backward raises after its last layer's buckets started their all-reduce: it used
    to leave the rest of the step unsent (the other group's remaining buckets met group 1's next
    step's first ones: other sizes, or silently the wrong tensors) and nobody heard of it. Now it
    sends the rest (zeros) and the next step's all-reduces line up and average as before. With
    find_unused_parameters the flags tell both groups ``aborted`` (each votes the step down);
    without, only group 1 knows (it votes down and heals; group 0's average holds group 1's last
    layer and zeros for its first)."""
    exchange, models, averages, x, own = _two_groups_of_an_mlp(monkeypatch, find_unused)
    hook = _raising_below(models[1][1])  # raises once the last Linear's gradients are in
    sent = 4 + (1 if find_unused else 0)  # 4 buckets, and the flags

    def failing_step(group):
        averages[group].arm()
        try:
            models[group](x[group]).sum().backward()
        except ValueError:
            assert group == 1 and len(exchange.sizes[1]) == 2  # the last layer's two buckets had left
            averages[group].finish(abort=True)
        else:
            averages[group].finish()
        assert averages[group].aborted == (find_unused or group == 1)  # in both groups with the flags

    _in_two_groups(failing_step)
    assert exchange.sizes[0] == exchange.sizes[1] and len(exchange.sizes[0]) == sent
    if not find_unused:  # group 0 committed this: group 1's last layer, and zeros for its first
        last = (2, 3)  # of the parameters 0.weight, 0.bias, 2.weight, 2.bias
        for i, p in enumerate(models[0].parameters()):
            expected = (own[0][i] + own[1][i]) / 2 if i in last else own[0][i] / 2
            assert torch.allclose(p.grad, expected), i
    hook.remove()
    for m in models:
        m.zero_grad(set_to_none=True)

    def next_step(group):
        averages[group].arm()
        models[group](x[group]).sum().backward()
        averages[group].finish()
        assert not averages[group].aborted

    _in_two_groups(next_step)
    assert exchange.sizes[0] == exchange.sizes[1] and len(exchange.sizes[0]) == 2 * sent
    for m in models:
        for p, g0, g1 in zip(m.parameters(), *own):
            assert torch.allclose(p.grad, (g0 + g1) / 2)


@pytest.mark.parametrize("find_unused", [True, False])
def test_a_backward_that_raises_after_the_last_bucket_left_leaves_the_others_a_whole_average(monkeypatch, find_unused):
    """Group 1's backward raises after every gradient of its step was in and every bucket (and the
    flags, with find_unused_parameters) had left: the average is whole, so group 0 is not told
    (it commits the step, with or without the flags) and group 1 alone sees ``aborted`` (it votes
    the step down and heals at its next quorum, torchft's rule). The next step lines up."""
    exchange, models, averages, x, own = _two_groups_of_an_mlp(monkeypatch, find_unused)
    sent = 4 + (1 if find_unused else 0)

    def step(group, raising):
        averages[group].arm()
        late = torch.ones(1, requires_grad=True) * 1.0  # made before the forward: its backward node runs last
        if raising and group == 1:
            def boom(_grad):
                raise ValueError("raised after the last bucket")
            late.register_hook(boom)
        try:
            (models[group](x[group]).sum() + late.sum()).backward()
        except ValueError:
            assert len(exchange.sizes[1]) == sent  # every bucket (and the flags) had left
            averages[group].finish(abort=True)
        else:
            averages[group].finish()
        assert averages[group].aborted == (raising and group == 1)

    _in_two_groups(lambda group: step(group, raising=True))
    assert exchange.sizes[0] == exchange.sizes[1] and len(exchange.sizes[0]) == sent
    for p, g0, g1 in zip(models[0].parameters(), *own):  # whole: group 1's every gradient is in it
        assert torch.allclose(p.grad, (g0 + g1) / 2)
    for m in models:
        m.zero_grad(set_to_none=True)
    _in_two_groups(lambda group: step(group, raising=False))
    assert exchange.sizes[0] == exchange.sizes[1] and len(exchange.sizes[0]) == 2 * sent
    for m in models:
        for p, g0, g1 in zip(m.parameters(), *own):
            assert torch.allclose(p.grad, (g0 + g1) / 2)


def test_accumulated_gradients_are_averaged_once_at_the_sync_step_as_ddp(monkeypatch):
    """gradient_accumulation_steps=2: the micro-step's backward is not armed (no all-reduce), the
    sync step's averages the accumulated gradients once (DDP: its no_sync micro-steps accumulate
    locally, the sync step all-reduces the sum), including a parameter that received its gradient
    in the micro-step only (DDP's find_unused_parameters=True reducer sends the gradient it holds)."""
    exchange, models = _two_groups(monkeypatch, 1, _Three)
    micro = (torch.ones(2, 4), torch.full((2, 4), 2.0))
    sync = (torch.full((2, 4), 3.0), torch.full((2, 4), -1.0))

    def accumulated(group, m):
        m(micro[group], 0).backward()  # b used in the micro-step, by both groups
        m(sync[group], 1).backward()  # and not in the sync step
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad(set_to_none=True)
        return grads

    own = [accumulated(g, m) for g, m in enumerate(models)]
    averages = [BucketedAverage(list(m.parameters()), exchange.allreduce(g), lambda: None, find_unused_parameters=True)
                for g, m in enumerate(models)]

    def step(group):
        models[group](micro[group], 0).backward()  # a micro-step: not armed
        assert not averages[group].finish() and exchange.sizes[group] == []
        averages[group].arm()
        models[group](sync[group], 1).backward()
        assert averages[group].finish()

    _in_two_groups(step)
    for m in models:
        grads = dict(m.named_parameters())
        for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
            assert torch.allclose(grads[name].grad, (own[0][name] + own[1][name]) / 2), name
        assert grads["c.weight"].grad is None


def test_fsdp2_units_cut_the_buckets_and_the_first_is_not_small(monkeypatch):
    """Under FSDP2 a unit's gradients are set together after its reduce-scatter: a small first bucket
    would only add an all-reduce (the benchmark's 2 x 2 layout: two per step where HSDP issues one),
    so buckets are cut at the units' boundaries (and at 25 MiB), as HSDP's all-reduce per unit."""
    small, big = torch.zeros(10), torch.zeros(averaging.FIRST_BUCKET_BYTES // 4)
    assert averaging.buckets_of([big, small, small]) == [[0], [1, 2]]  # DDP's rule: the first closes at 1 MiB
    assert averaging.buckets_of([big, small, small], units=[0, 0, 0]) == [[0, 1, 2]]
    assert averaging.buckets_of([small, big, small, small], units=[1, 1, 0, 0]) == [[0, 1], [2, 3]]
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    params = list(model.parameters())
    units = {id(p): 0 for p in params}
    assert BucketedAverage(params, lambda flat: _Done(), lambda: None, units).bucket_count == 1
    units.pop(id(params[0]))  # a parameter outside every unit: DDP's rule for all
    monkeypatch.setattr(averaging, "FIRST_BUCKET_BYTES", 8)
    assert BucketedAverage(params, lambda flat: _Done(), lambda: None, units).bucket_count == 2
    assert averaging.fsdp_units([model]) == {}  # no FSDP2 unit


def test_fsdp2_buckets_follow_the_order_backward_finishes_the_units_root_last():
    """The usual layout (fully_shard on each block, then on the root, which owns the embedding and
    the head): by reversed registration the head (the root's) was bucket 0, and FSDP2 sets the
    root's gradients last, so no bucket could start during backward, and the root took two
    all-reduces. Now the blocks' buckets come first, last block first, and the root's parameters
    are one bucket at the end: every bucket starts during backward, in that order."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(100, 16)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
            self.head = torch.nn.Linear(16, 100)

        def forward(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = torch.relu(layer(h))
            return self.head(h)

    own = not dist.is_initialized()  # (a one-process group an earlier test of this worker left is as good)
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        model = Net()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        names = {id(p): n for n, p in model.named_parameters()}
        started = []

        def allreduce(flat):
            started.append(flat.numel())
            return _Done()

        params = list(model.parameters())
        avg = BucketedAverage(params, allreduce, lambda: None, averaging.fsdp_units([model]))
        buckets = [sorted(names[id(avg._params[i])].split(".")[0] + "." + names[id(avg._params[i])].split(".")[1]
                          for i in b) for b in avg._buckets]
        assert buckets == [["layers.2", "layers.2"], ["layers.1", "layers.1"], ["layers.0", "layers.0"],
                           ["embed.weight", "head.bias", "head.weight"]], buckets
        avg.arm()
        model(torch.randint(0, 100, (4, 8))).sum().backward()
        assert avg.started_early == 4  # every bucket left during backward (the root's last, as FSDP2 sets it)
        assert avg.finish()
        assert started[:3] == [16 * 16 + 16] * 3 and started[3] == 100 * 16 + 100 * 16 + 100
    finally:
        if own:
            dist.destroy_process_group()


def test_under_ddp_every_bucket_starts_after_backward_from_the_gradients_ddp_wrote(monkeypatch):
    """DDP inside a group of several processes: DDP's reducer writes the group's average into .grad
    only when backward ends, so a parameter's hook sees this rank's own gradient. Here a real DDP
    (one process on gloo) whose comm hook triples each bucket stands for the group's average (it
    differs from the rank's own gradient, as an average over 2 ranks would). With ``after_backward``
    (what :func:`averaging.synced_after_backward` asks for when a prepared model is DDP, compiled
    or not), no bucket starts during backward and finish() averages what DDP wrote: 3 x 0.5 the
    rank's own gradient, with and without ``gradient_as_bucket_view``. Without it the buckets left
    from the hooks and their averages were copied over DDP's (0.5 x): the ranks of a group drifted
    apart (tests/fault_tolerance/test_fault_tolerance_multiprocess.py, the DDP test)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    def tripled(_state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer().mul_(3.0))
        return fut

    own_group = not dist.is_initialized()  # (a one-process group an earlier test of this worker left is as good)
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for after_backward, as_view in ((True, False), (True, True), (False, False)):
            torch.manual_seed(0)
            plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
            x = torch.randn(3, 4)
            plain(x).sum().backward()
            own = [p.grad.clone() for p in plain.parameters()]
            torch.manual_seed(0)
            model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
                                            gradient_as_bucket_view=as_view)
            model.register_comm_hook(None, tripled)
            started = []

            def allreduce(flat):
                started.append(flat.numel())
                flat.mul_(0.5)  # "the average of two groups, the other all zeros"
                return _Done()

            avg = BucketedAverage(list(model.parameters()), allreduce, lambda: None, after_backward=after_backward)
            avg.arm()
            model(x).sum().backward()
            assert avg.started_early == (0 if after_backward else len(started))
            assert avg.finish()
            factor = 3.0 * 0.5 if after_backward else 0.5  # (without: DDP's result overwritten)
            for p, g in zip(model.parameters(), own):
                assert torch.allclose(p.grad, g * factor), (after_backward, as_view)
            avg.close()
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
        assert averaging.synced_after_backward([torch.nn.Linear(2, 2), ddp])
        assert averaging.synced_after_backward([torch.compile(ddp)])  # (compiled lazily: nothing compiles here)
        assert not averaging.synced_after_backward([torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU())])
    finally:
        if own_group:
            dist.destroy_process_group()
