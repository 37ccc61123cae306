"""Sampling one step ahead: step n+1's completions generated while step n trains, on one GPU.

The decode is bound by memory and the training pass by compute and the host, so the two can share the GPU's
time (benchmarks/RESULTS.md, "The measured defaults", has the figure). `SampleAhead` is an engine around
another, built over a copy of the policy that shares the base weights: `prefetch(prompts, n, sampling)` takes
the adapters as they are now into the copy and starts the generate on it, in a thread and on a CUDA stream of
its own; the `generate` that asks for the same prompts, n and sampling later returns that rollout. So step n+1
trains on completions of the policy before step n's update: one step off the policy, its tokens weighted by
pi_trainer / pi_sampler (`needs_importance_correction`), and the sampler-trainer gap in the log measures the
difference.

The copy takes the adapters one of two ways. Folded (`fold`, dense base weights): W + scale * B A rounded into
a copy of each adapted projection's weight, which the engine reads with no adapter work (about 2.6 GB more for
a 1.5B model's seven projections a layer). Else (FP8 weights, which would need a new quantization, or
--no-engine-fold-adapter) a copy of the adapters alone, which the engine reads beside the shared base weights.

The step's `time/generate` is then the time it waited for the rollout, and `time/generate/decode` the decode's
own, in the background. Any other `generate` (an evaluation, the first step, a resumed run's) waits for the one
in flight, takes the adapters as they are and samples at once; the rollout in flight stays for the generate that
asks for it. A run that stops drops it: a resumed run samples its first step from the policy it resumes.

What it deliberately is not: a second process or an asynchronous trainer. One rollout at most is ahead, and the
loop stays one step at a time (`grpo.step`).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from grpo.rollout.base import Engine, Rollout, Sampling


def refusal(policy: nn.Module) -> str | None:
    """Why the adapters of `policy` (a PeftModel) cannot be taken into a copy, or None: every LoRA layer one
    plain adapter (scale * B A)."""
    layers = lora_layers(policy)
    if not layers:
        return "the policy has no LoRA layers to copy"
    for layer in layers:
        if len([a for a in layer.active_adapters if a in layer.lora_A]) != 1:
            return "each LoRA layer needs exactly one active adapter"
        if layer.lora_variant or any(getattr(layer, "lora_bias", {}).values()):
            return "DoRA and other LoRA variants are not scale * B A"
    return None


def folds(policy: nn.Module) -> bool:
    """Whether every base layer under an adapter is an nn.Linear of floating-point weights, which the adapter
    folds into (FP8 weights would need a new quantization)."""
    return all(type(layer.base_layer) is nn.Linear and layer.base_layer.weight.is_floating_point()
               for layer in lora_layers(policy))


def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]


def _active(layer: nn.Module) -> str:
    return next(a for a in layer.active_adapters if a in layer.lora_A)


@dataclass
class _Folded:
    """One adapted projection: the copy's weight and where the policy keeps the base weight and adapter."""

    weight: torch.Tensor  # (out, in) the copy's, written by each take
    base: torch.Tensor  # (out, in) the policy's base weight
    lora_a: torch.Tensor  # (r, in)
    lora_b: torch.Tensor  # (out, r)
    scale: float

    def take(self) -> None:
        """weight <- base + scale * B A, in float32, rounded once (as `grpo.rollout.native.fold` folds)."""
        summed = torch.addmm(self.base.float(), self.lora_b.float(), self.lora_a.float(), alpha=self.scale)
        self.weight.copy_(summed)


@dataclass
class _Copied:
    """One adapter tensor: the copy's and the policy's."""

    weight: torch.Tensor  # the copy's, written by each take
    source: torch.Tensor  # the policy's

    def take(self) -> None:
        self.weight.copy_(self.source)


def _copy_sharing(policy: nn.Module, own: set[int]) -> nn.Module:
    """The policy's base model anew, every tensor the policy's own except those whose id is in `own` (copied, and
    frozen), in eval mode, with none of the training's bound forwards (`compiled_layers`, `lean_activations`,
    `lora_addmm`)."""
    base = policy.get_base_model()
    shared = {id(t): t for t in (*base.parameters(), *base.buffers()) if id(t) not in own}
    model = copy.deepcopy(base, memo=shared)
    for module in model.modules():
        module.__dict__.pop("forward", None)  # a training-only forward bound on the instance: the class's again
    for p in model.parameters():
        if id(p) not in shared:  # the shared ones are the policy's: what it trains stays trainable
            p.requires_grad_(False)
    return model.eval()


def folded_copy(policy: nn.Module) -> tuple[nn.Module, list[_Folded]]:
    """(a model that samples like `policy` with its adapters folded, its projections to fold): every tensor
    shared except the adapted projections' weights, each LoRA layer an nn.Linear of its own weight."""
    model, taken = _copy_sharing(policy, own=set()), []
    for name, module in list(model.named_modules()):
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            continue
        linear, adapter = module.base_layer, _active(module)
        plain = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          device="meta", dtype=linear.weight.dtype)
        plain.weight = nn.Parameter(torch.empty_like(linear.weight), requires_grad=False)
        plain.bias = linear.bias  # shared: folding leaves it as it is
        taken.append(_Folded(plain.weight.data, linear.weight, module.lora_A[adapter].weight,
                             module.lora_B[adapter].weight, float(module.scaling[adapter])))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, plain)
    return model, taken


def adapters_copy(policy: nn.Module) -> tuple[nn.Module, list[_Copied]]:
    """(a model that samples like `policy`, its adapter tensors to copy): every tensor shared except the active
    adapters' A and B, which are the copy's own."""
    sources = [getattr(layer, part)[_active(layer)].weight for layer in lora_layers(policy)
               for part in ("lora_A", "lora_B")]
    model = _copy_sharing(policy, own={id(t) for t in sources})
    mine = [getattr(layer, part)[_active(layer)].weight for layer in lora_layers(model)
            for part in ("lora_A", "lora_B")]
    return model, [_Copied(m.data, t) for m, t in zip(mine, sources, strict=True)]


def _request(prompt_ids: list[list[int]], num_generations: int, sampling: Sampling) -> tuple:
    """What a generate was asked, as `prefetch` keeps it and `generate` compares it: one form for both, or the
    rollout started ahead would never be received."""
    return [list(p) for p in prompt_ids], num_generations, sampling


@dataclass
class _InFlight:
    """A generate running in the background, and what it was asked."""

    request: tuple
    thread: threading.Thread
    done: torch.cuda.Event | None  # recorded on the sampler's stream when the rollout is written (CUDA)
    rollout: Rollout | None = None
    error: BaseException | None = None


class SampleAhead:
    """An engine (`grpo.rollout.base.Engine`) that samples a copy of the policy, and can start a generate ahead
    of the step that reads it. See the module docstring.

    policy: the PeftModel being trained (one plain adapter a LoRA layer).
    build: the engine that samples, built over the model it is given (the copy): the native engine, which samples
        from a generator of its own (transformers' generate reseeds torch's global generators, which the training
        thread draws from). Over a copy of the adapters alone it must not fold them: the base weights are shared.
    fold: fold the adapters into a copy of the weights where they are dense (`folds`); else copy the adapters.
    """

    needs_importance_correction = True  # one step off the policy (and where folded, the adapters rounded)

    def __init__(self, policy: nn.Module, build: Callable[[nn.Module], Engine], fold: bool = True) -> None:
        why = refusal(policy)
        if why is not None:
            raise ValueError(f"--sample-ahead: {why}; fix: pass --no-sample-ahead")
        self.folded = fold and folds(policy)
        self.model, self._copies = (folded_copy if self.folded else adapters_copy)(policy)
        self.engine = build(self.model)
        if not self.folded and getattr(getattr(self.engine, "tuning", None), "fold_adapter", False) and folds(policy):
            # it would fold the adapters into the base weights in place: the policy's, which the update reads
            raise ValueError("SampleAhead(fold=False) on dense base weights needs an engine that does not fold the "
                             "adapters: build it with fold_adapter=False")
        device = self._copies[0].weight.device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._in_flight: _InFlight | None = None

    @property
    def progress(self):
        return getattr(self.engine, "progress", None)

    @progress.setter
    def progress(self, progress) -> None:
        self.engine.progress = progress

    def __getattr__(self, name: str):  # the engine's own (tuning, kv_cache_bytes, ...): what it says of itself
        # not `engine` before __init__ sets it (no recursion), nor the engine's episodes, which would neither wait
        # for the generate in flight nor fold (episodes then go turn by turn through `generate`)
        if name in ("engine", "turns"):
            raise AttributeError(name)
        return getattr(self.engine, name)

    def take_adapters(self) -> None:
        """The adapters as they are now into the copy, queued on this thread's stream."""
        with torch.no_grad():
            for copied in self._copies:
                copied.take()

    def prefetch(self, prompt_ids: list[list[int]], num_generations: int, sampling: Sampling) -> None:
        """Starts the generate of these prompts from the policy as it is now; the `generate` that asks for the same
        returns it. The adapters are taken on this thread's stream before anything after this call (the optimizer's
        update), so the update cannot reach the tensors the generate reads."""
        self.wait()
        self.take_adapters()
        request = _request(prompt_ids, num_generations, sampling)
        cuda = self._stream is not None
        taken = torch.cuda.Event() if cuda else None
        if cuda:
            taken.record()
        # not a daemon: a process that ends (a run stopped between steps) waits for the generate rather than killing
        # it inside a torch call, which aborts the process
        job = _InFlight(request, threading.Thread(target=lambda: self._run(job, taken), daemon=False),
                        torch.cuda.Event() if cuda else None)
        self._in_flight = job
        job.thread.start()

    def _run(self, job: _InFlight, taken: torch.cuda.Event | None) -> None:
        progress = getattr(self.engine, "progress", None)
        self.engine.progress = None  # the bar shows what the foreground does
        try:
            if self._stream is None:
                job.rollout = self.engine.generate(*job.request)
                return
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(taken)
                job.rollout = self.engine.generate(*job.request)
                job.done.record()
        except BaseException as err:  # raised in the thread that asks for the rollout
            job.error = err
        finally:
            self.engine.progress = progress

    def wait(self) -> None:
        """Until the generate in flight (if any) has finished, and this thread's stream after its work (what is
        queued here next may free or write what it read); its rollout stays for the generate that asks."""
        job = self._in_flight
        if job is not None:
            job.thread.join()
            if job.done is not None and job.error is None:
                torch.cuda.current_stream().wait_event(job.done)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: Sampling) -> Rollout:
        """The rollout started ahead for exactly these arguments, else one sampled now from the policy as it is."""
        request = _request(prompt_ids, num_generations, sampling)
        job = self._in_flight
        self.wait()
        if job is not None and job.request == request:
            self._in_flight = None
            if job.error is not None:
                raise job.error
            return self._received(job)
        self.take_adapters()
        return self.engine.generate(prompt_ids, num_generations, sampling)

    def _received(self, job: _InFlight) -> Rollout:
        """The background rollout's tensors, copied on this thread's stream (freed later here, they leave the
        sampler's memory to the sampler)."""
        rollout = job.rollout  # (`wait` has ordered this thread's stream after the sampler's)
        tensors = {f.name: getattr(rollout, f.name).clone() for f in dataclasses.fields(rollout)
                   if isinstance(getattr(rollout, f.name), torch.Tensor)}
        return dataclasses.replace(rollout, **tensors)

    def release_memory(self) -> None:
        self.wait()
        self.engine.release_memory()

    def standby_bytes(self) -> int | None:
        return self.engine.standby_bytes()
