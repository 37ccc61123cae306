"""What the host issues for one training micro-batch and one reference pass of the bench step, counted op by op.

Where the host bounds a pass (it issues ops slower than the GPU runs them: `train_graph.py` says whether it does), what
it costs is how many ops it issues and the Python around each. This counts them with the trainer's own pieces
(`grpo.step.update_policy` and `reference_and_old_logprobs`) on a model of the bench's structure (Llama-3.2-1B's
16 layers and heads ratio, rsLoRA r=32 on the 7 projections, gradient checkpointing, the trainer's LoRA and MLP
forwards, beta 0.04, 8-bit AdamW: `bench_setup.step_config`), 16 rows of 128 + 512 tokens in one micro-batch:
- aten ops (what the dispatcher sees: views included, each a launch or at least a dispatch) per decoder layer in the
  forward, the backward (the checkpoint's recomputation and detaches included) and the reference pass, and the
  rest by phase (embedding, final norm, log-probs, loss, statistics, clipping, optimizer): the pass over 16 layers
  less the pass over 8, per layer;
- one LoRA projection's ops, forward and backward, on the tokens as rows and on (B, T, in);
- every read of a tensor's value on the host (`.item()`, `bool()`, `nonzero`...: a wait for the device where the
  tensor is on a GPU; on a CPU run the host's own tensors are among them), with the line that issued it;
- Python function calls by phase and per layer, the checkpoint's pack and unpack hooks and modules' calls among
  them.
No timings: counts, the same on any machine for the same versions. A CPU run (`--widths tiny`, the default there)
runs torch's RMSNorm ops where CUDA runs one Triton launch each way (`grpo.kernels.rmsnorm`).

    PYTHONPATH=$PWD python3 benchmarks/probes/train_ops.py [--widths 1b]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_setup
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup as bs  # noqa: E402
from timing import Recorder, add_out_argument  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Ops that read a tensor's value into the host: a wait for the device when the tensor is on a GPU
HOST_READS = ("_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "unique", "_unique2")
# Python functions whose calls are counted by name: the checkpoint's hooks per saved tensor, a module's call
HOOKS = ("pack_hook", "unpack_hook", "_call_impl", "get_model_status")
# Tiny widths of the bench's structure for a CPU run: the same layers, heads ratio, tied head and rope
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            vocab_size=512, bos_token_id=1, eos_token_id=[2], pad_token_id=0)


class PhaseOps(TorchDispatchMode):
    """Counts aten ops by the phase they are issued in (`phase`, set by `in_phase`), and records where each read
    of a value into the host comes from."""

    def __init__(self):
        super().__init__()
        self.phase = "other"
        self.ops: collections.Counter = collections.Counter()  # (phase, op) -> count
        self.reads: collections.Counter = collections.Counter()  # (phase, op, where, device) -> count
        self.calls: collections.Counter = collections.Counter()  # (phase, "python" | "builtin" | hook) -> count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[(self.phase, name)] += 1
        if name in HOST_READS:
            device = next((str(a.device) for a in args if isinstance(a, torch.Tensor)), "?")
            self.reads[(self.phase, name, caller(), device)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def python_calls(self):
        """Inside, Python function calls (and calls of builtins, torch's tensor methods among them) are counted by
        phase instead of ops, with the calls of HOOKS by name. This thread only: on CUDA, autograd runs the
        backward's Python (the checkpoint's unpack hooks, custom Functions' backward) on a thread of its own."""
        def profile(frame, event, arg):
            if event == "call":
                self.calls[(self.phase, "python")] += 1
                if frame.f_code.co_name in HOOKS:
                    self.calls[(self.phase, frame.f_code.co_name)] += 1
            elif event == "c_call":
                self.calls[(self.phase, "builtin")] += 1

        sys.setprofile(profile)
        try:
            yield
        finally:
            sys.setprofile(None)

    def by_phase(self) -> dict[str, collections.Counter]:
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for (phase, op), n in self.ops.items():
            out[phase][op] += n
        return out


def caller() -> str:
    """The innermost frame outside torch: the line of ours, transformers' or peft's that issued an op."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename:
            return f"{frame.filename.split('site-packages/')[-1].removeprefix(str(ROOT) + '/')}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def phases(counter: PhaseOps, optimizer):
    """Each piece of the update labels the ops it issues (grpo.step's names wrapped for as long as this lasts)."""
    import grpo.step as step

    wrapped = [(step, "sequence_logprobs", "forward"), (step, "clipped_surrogate", "loss"),
               (step, "accumulate_stats", "statistics"), (torch.Tensor, "backward", "backward"),
               (torch.nn.utils, "clip_grad_norm_", "clipping"), (optimizer, "step", "optimizer"),
               (step, "reference_and_old_logprobs", "reference")]
    saved = []
    for owner, name, phase in wrapped:
        fn = getattr(owner, name)

        def in_phase(*args, _fn=fn, _phase=phase, **kwargs):
            before, counter.phase = counter.phase, _phase
            try:
                return _fn(*args, **kwargs)
            finally:
                counter.phase = before

        setattr(owner, name, in_phase)
        saved.append((owner, name, fn))
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def bench_policy(layers: int, widths: str, device: torch.device):
    """(policy, cfg): the bench's model structure with `layers` layers in bf16, its rsLoRA as the bench trains it,
    B non-zero as after some training."""
    from transformers import LlamaForCausalLM

    from grpo.model.load import add_lora

    config = bs.model_config("1b")
    for key, value in (TINY if widths == "tiny" else {}).items():
        setattr(config, key, value)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.requires_grad_(False)
    cfg = bs.step_config("unused", "unused", bs.BENCH, fp8=False, steps=1, output_dir="unused",
                         cuda=device.type == "cuda")
    policy = add_lora(model, cfg)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return policy, cfg


def bench_batch(vocab: int, device: torch.device):
    """The bench's rows: 4 prompts x 4 completions of 128 + 512 tokens, every completion token counted."""
    from grpo.batch import make_batch
    from grpo.rollout.base import Rollout

    gen = torch.Generator().manual_seed(0)
    shape = bs.BENCH
    prompts = [torch.randint(10, vocab, (shape.prompt_len,), generator=gen).tolist() for _ in range(shape.prompts)]
    ids = torch.randint(10, vocab, (shape.rows, shape.completion_len), generator=gen)
    rollout = Rollout(prompt_ids=prompts, completion_ids=ids, mask=torch.ones(ids.shape, dtype=torch.bool),
                      sampler_logp=torch.zeros(ids.shape), finished=torch.ones(shape.rows, dtype=torch.bool),
                      num_generations=shape.generations)
    return make_batch(rollout, 0, device)


def step_setup(policy, cfg, device: torch.device):
    """The fields of `StepSetup` that the update and the reference pass read (as train_pass.py builds them)."""
    from types import SimpleNamespace

    from grpo.distributed import World
    from grpo.optim import make_optimizer

    params = [p for p in policy.parameters() if p.requires_grad]
    return SimpleNamespace(cfg=cfg, world=World(device=device), policy=policy, params=params,
                           optimizer=make_optimizer(cfg, params),
                           engine=SimpleNamespace(needs_importance_correction=False),
                           clock=lambda: 0.0, max_completion_length=bs.BENCH.completion_len)


def count_step(layers: int, widths: str, device: torch.device) -> PhaseOps:
    """The reference pass and one update (one micro-batch of the 16 rows, its optimizer step) at `layers` layers,
    after one of each to warm up (the optimizer's state): ops by phase, then Python calls by phase."""
    import grpo.step as step
    from grpo.batch import micro_batches

    policy, cfg = bench_policy(layers, widths, device)
    setup = step_setup(policy, cfg, device)
    batch = bench_batch(policy.config.vocab_size, device)
    adv = torch.linspace(-1, 1, len(batch), device=device)
    batch, adv, slices = micro_batches(batch, adv, cfg.micro_batch_size or cfg.batch_size)

    def one_step() -> None:
        policy.eval()  # as grpo_step: the reference pass in eval mode, the update sets train mode
        ref_logp, _, _ = step.reference_and_old_logprobs(setup, batch, slices)
        step.update_policy(setup, batch, slices, adv, ref_logp, None, step.InFlight({}))

    one_step()
    counter = PhaseOps()
    with phases(counter, setup.optimizer):
        with counter:
            one_step()
        with counter.python_calls():
            one_step()
    return counter


def projection_ops(widths: str, device: torch.device) -> dict:
    """One adapted projection (an MLP's up_proj) issued forward and backward, on rows and on (B, T, in)."""
    policy, _ = bench_policy(1, widths, device)
    layer = policy.get_base_model().model.layers[0].mlp.up_proj
    out = {}
    for name, shape in (("rows", (64,)), ("btd", (4, 16))):
        x = torch.randn(*shape, layer.in_features, dtype=torch.bfloat16, device=device, requires_grad=True)
        forward, backward = PhaseOps(), PhaseOps()
        with forward:
            y = layer(x)
        grad = torch.ones_like(y)
        with backward:
            y.backward(grad)
        out[name] = {"forward": dict(forward.by_phase()["other"]), "backward": dict(backward.by_phase()["other"])}
    return out


def per_layer(full: collections.Counter, half: collections.Counter, layers: int) -> tuple[dict, dict]:
    """(ops of one layer, ops of the rest) from counts at `layers` and `layers // 2` layers."""
    one = {op: (full[op] - half[op]) / (layers - layers // 2) for op in full if full[op] != half[op]}
    rest = {op: full[op] - one.get(op, 0) * layers for op in full}
    return one, {op: n for op, n in rest.items() if n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--widths", choices=["tiny", "1b"], default=None,
                        help="the model's widths: tiny (hidden 64, vocabulary 512) or Llama-3.2-1B's; the structure "
                             "is the bench's either way. Default: 1b on CUDA, tiny elsewhere")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (the bench's 16); halved for the rest")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.layers < 2:
        parser.error(f"--layers {args.layers}: at least 2 (the count per layer compares it with half as many)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    widths = args.widths or ("1b" if device.type == "cuda" else "tiny")
    rec = Recorder("train_ops", args.out)
    full, half = (count_step(n, widths, device) for n in (args.layers, args.layers // 2))
    full_ops, half_ops = full.by_phase(), half.by_phase()
    share = args.layers - args.layers // 2
    for phase in sorted(full_ops):
        one, rest = per_layer(full_ops[phase], half_ops[phase], args.layers)
        calls = {kind: n for (p, kind), n in full.calls.items() if p == phase}
        calls_per_layer = {kind: (n - half.calls[(phase, kind)]) / share for kind, n in calls.items()}
        rec.record("phase", phase=phase, widths=widths, device=str(device), total=full_ops[phase].total(),
                   per_layer=round(sum(one.values()), 1), rest=sum(rest.values()),
                   python_calls=calls, python_calls_per_layer=calls_per_layer,
                   per_layer_ops=dict(sorted(one.items(), key=lambda kv: -kv[1])),
                   rest_ops=dict(sorted(rest.items(), key=lambda kv: -kv[1])))
    for (phase, op, where, on), n in sorted(full.reads.items()):
        rec.record("host_read", phase=phase, op=op, where=where, tensor_device=on, count=n)
    rec.record("projection", widths=widths, **projection_ops(widths, device))


if __name__ == "__main__":
    main()
