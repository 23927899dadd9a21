"""A few GRPO steps on SmolLM2-135M-Instruct, on the CPU, with kforge as the environment (issue 48's RL loop).

kforge up &  .venv/bin/python examples/trainers/trl/grpo_smollm2.py [--steps 2] [--group 2] [--json out.json]

Each step:
1. **start**: one `single-turn` Step API episode per sample (`StartEpisode`, CPU backend): each task's group of
   `--group` episodes, whose first observation is the recipe's prompt.
2. **generation**: the trainer's own model samples each response (temperature `--temperature`, at most
   `--max-new-tokens`), keeping every sampled token's id and log-probability under the sampling distribution.
3. **evaluation**: each response goes back as the turn's `Completion` (token ids, log-probabilities, finish reason)
   with the prompt's token ids (`Step`): kforge extracts the kernel, evaluates it, scores it (the Kevin score) and
   diagnoses it, and stores the turn. The reward is kforge's score.
4. **reward**: kforge's reward service turns each task group's returns into GRPO advantages (`ComputeAdvantages`);
   the samples are read back from kforge's store (`ExportSamples`: token ids and log-probabilities as stored);
   the trainer's recomputed log-probabilities go through kforge's mismatch rejection (`RejectMismatched`, MRS),
   whose decisions drop samples from the loss.
5. **optimiser**: loss = mean over the kept samples of the token mean of `-A * ratio - entropy_coef * entropy`
   (ratio = exp(logp - logp.detach()): one update per batch, so it is 1 and its gradient is A * grad logp), then
   one AdamW step.

The model is the GGUF file that llama.cpp's server serves (`scripts/setup_model.sh --print-model`), loaded by
transformers (`gguf_file=`, the `gguf` package), de-quantised to float32.

The small model almost never writes a kernel that passes, so a group's rewards are usually all 0, its GRPO
advantages exactly 0 and its policy gradient 0. kforge's rewards have no negative term for a response without a
kernel or out of format (both score 0; only a hack's penalty can be negative). The weights then move through the
entropy bonus alone (`--entropy-coef`); the summary says which of the two drove each step (`policy_gradient`).

Prints loss, mean reward, kforge's job metrics and the time of each part per step; `--json` writes all of it,
with each sample's token ids and log-probabilities and the weights' change, for the test.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import kforge
from kforge.v1 import common_pb2, gateway_pb2, orchestrator_pb2, reward_pb2

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / ".venv" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TASKS = REPO / "examples" / "tasks"

# transformers' own annotations leave much untyped (GenerationConfig, generate); it is used as untyped here.
transformers: Any = importlib.import_module("transformers")


@dataclass
class Rollout:
    """One sample: its episode, the trainer's tokens, and what kforge made of it."""

    task: str
    episode_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    text: str = ""
    reward: float = 0.0
    verdict: str = ""
    flags: dict[str, Any] = field(default_factory=dict)
    advantage: float = 0.0
    cursor: str = ""
    train_logprobs: list[float] = field(default_factory=list)
    keep: bool = True
    importance_weight: float = 1.0
    mismatch_reason: str = ""


@dataclass
class StepReport:
    """What one step printed, and the samples behind it."""

    step: int
    loss: float
    mean_reward: float
    policy_gradient: bool
    kept: int
    mismatch_max_abs: float
    mismatch_mean_abs: float
    metrics: dict[str, float]
    seconds: dict[str, float]
    rollouts: list[Rollout]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orchestrator", default=os.environ.get("KFORGE_ORCHESTRATOR", "http://127.0.0.1:50055"))
    parser.add_argument("--reward", default=os.environ.get("KFORGE_REWARD", "http://127.0.0.1:50053"))
    parser.add_argument("--model", type=Path, default=MODEL, help="the GGUF file (scripts/setup_model.sh)")
    parser.add_argument("--tasks", default="relu,row_sum", help="example tasks (examples/tasks/<name>)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--group", type=int, default=2, help="samples per task and step (the GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--entropy-coef", type=float, default=0.01)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch's threads (see the README: 1 on a busy 2-core box)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the summary here")
    return parser.parse_args(argv)


def load(path: Path) -> tuple[Any, Any]:
    """The GGUF file as a float32 transformers model, and its tokenizer (the file's own)."""
    if not path.is_file():
        raise SystemExit(f"no model at {path}: run scripts/setup_model.sh")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model, tokenizer


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat prompt as the model's chat template tokenizes it, ready for the assistant's answer."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return [int(token) for token in encoded["input_ids"]]


@torch.no_grad()
def sample(
    model: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    eos: int,
) -> list[tuple[list[int], list[float], bool]]:
    """A response to each prompt, all in one batch (left-padded).

    Each is its token ids (up to and with the end-of-turn token), their log-probabilities under
    softmax(logits / temperature), the distribution sampled from, and whether it stopped before the token limit.
    """
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[eos] * (width - len(prompt)) + prompt for prompt in prompts])
    attention_mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    config = transformers.GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,  # no truncation: sampled from the whole softmax(logits / temperature)
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    new = out.sequences[:, width:]
    raw = torch.stack(out.logits, dim=1).float() / temperature  # the model's own logits, not the processed scores
    logprobs = torch.log_softmax(raw, dim=-1).gather(2, new[:, :, None]).squeeze(2)
    responses: list[tuple[list[int], list[float], bool]] = []
    for tokens, values in zip(new.tolist(), logprobs.tolist(), strict=True):
        length = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        responses.append((tokens[:length], values[:length], eos in tokens))
    return responses


def recompute(model: Any, rollouts: list[Rollout], temperature: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The trainer's log-probabilities of each response token (with their gradient) and the entropy at each."""
    logprobs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for rollout in rollouts:  # one at a time: no padding, and the activations of one sequence at once
        ids = torch.tensor([rollout.prompt_ids + rollout.token_ids])
        # The logits that predict the response's tokens only: the vocabulary projection skips the prompt.
        kept = len(rollout.token_ids) + 1
        logits = model(input_ids=ids, logits_to_keep=kept).logits[0, :-1, :].float() / temperature
        distribution = torch.log_softmax(logits, dim=-1)
        logprobs.append(distribution.gather(1, torch.tensor(rollout.token_ids)[:, None]).squeeze(1))
        entropies.append(-(distribution.exp() * distribution).sum(-1))
    return logprobs, entropies


def job_metrics(client: kforge.Client, episode_ids: list[str]) -> dict[str, float]:
    """The job metrics kforge keeps, added up over the step's episodes (each a job of one turn)."""
    totals: dict[str, float] = {}
    for episode_id in episode_ids:
        metrics = client.orchestrator.get_job(orchestrator_pb2.GetJobRequest(job_id=episode_id)).metrics
        counts = {
            "turns": metrics.turns,
            "evaluated": metrics.evaluated,
            "correct": metrics.correct,
            "compile_errors": metrics.overall.compile_error.numerator,
            "no_kernel": metrics.no_kernel,
            "junk": metrics.junk,
            "format_errors": metrics.format_errors,
            "not_okay": metrics.not_okay,
            "infra_errors": metrics.infra_errors,
        }
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
    return totals


def start_episodes(client: kforge.Client, tokenizer: Any, names: list[str], args: argparse.Namespace) -> list[Rollout]:
    """A `single-turn` episode per sample, `--group` per task, each with its prompt tokenized."""
    rollouts: list[Rollout] = []
    for name in names:
        task = common_pb2.Task(task_id=f"examples/{name}", source=(TASKS / name / "task.py").read_text())
        for _ in range(args.group):
            episode = kforge.Episode.start(
                client.orchestrator, recipe="single-turn", task=task, turns=1, backend=args.backend
            )
            rollouts.append(Rollout(task.task_id, episode.id, prompt_ids(tokenizer, episode.messages)))
    return rollouts


def step_episodes(client: kforge.Client, rollouts: list[Rollout]) -> None:
    """Each response as its episode's turn (Step, all at once): kforge evaluates, scores and diagnoses it."""

    def step_one(rollout: Rollout) -> orchestrator_pb2.Observation:
        completion = gateway_pb2.Completion(
            text=rollout.text,
            finish_reason=rollout.finish_reason,
            token_ids=rollout.token_ids,
            logprobs=rollout.logprobs,
            completion_tokens=len(rollout.token_ids),
        )
        episode = kforge.Episode.resume(client.orchestrator, rollout.episode_id)
        return episode.step(completion, prompt_token_ids=rollout.prompt_ids)

    with ThreadPoolExecutor(max_workers=len(rollouts)) as pool:
        observations = list(pool.map(step_one, rollouts))
    for rollout, observation in zip(rollouts, observations, strict=True):
        if not observation.done or not observation.HasField("record") or observation.record.error:
            raise RuntimeError(f"episode {rollout.episode_id} failed: {observation.record.error or 'not done'}")
        rollout.reward = observation.reward
        rollout.verdict = common_pb2.Verdict.Name(observation.record.verdict)
        flags = observation.record.flags
        rollout.flags = {"no_kernel": flags.no_kernel, "junk": flags.junk, "truncated": flags.truncated}


def credit(client: kforge.Client, rollouts: list[Rollout]) -> None:
    """GRPO advantages over each task's group from kforge's reward service, and each sample's cursor (export)."""
    tasks = sorted({rollout.task for rollout in rollouts})
    groups = [
        reward_pb2.AdvantageGroup(
            group_id=task,
            trajectories=[
                reward_pb2.TrajectoryValues(trajectory_id=rollout.episode_id, values=[rollout.reward])
                for rollout in rollouts
                if rollout.task == task
            ],
        )
        for task in tasks
    ]
    answer = client.reward.compute_advantages(
        reward_pb2.ComputeAdvantagesRequest(estimator=reward_pb2.ADVANTAGE_ESTIMATOR_GRPO, groups=groups)
    )
    advantages = {t.trajectory_id: t.values[0] for group in answer.groups for t in group.trajectories}
    for rollout in rollouts:
        rollout.advantage = advantages[rollout.episode_id]
        request = orchestrator_pb2.ExportSamplesRequest(job_id=rollout.episode_id)
        (exported,) = client.orchestrator.export_samples(request)
        if list(exported.response.token_ids) != rollout.token_ids:
            raise RuntimeError(f"episode {rollout.episode_id}: kforge exported other token ids than were sampled")
        rollout.cursor = exported.cursor


def reject_mismatched(client: kforge.Client, rollouts: list[Rollout], train: list[torch.Tensor]) -> None:
    """The trainer's log-probabilities through kforge's MRS (RejectMismatched); its decisions kept per sample."""
    for rollout, values in zip(rollouts, train, strict=True):
        rollout.train_logprobs = [float(value) for value in values.detach()]
        request = orchestrator_pb2.RejectMismatchedRequest(
            job_id=rollout.episode_id,
            samples=[orchestrator_pb2.TrainLogprobs(cursor=rollout.cursor, logprobs=rollout.train_logprobs)],
        )
        (decision,) = client.orchestrator.reject_mismatched(request).decisions
        rollout.keep, rollout.importance_weight = decision.keep, decision.importance_weight
        rollout.mismatch_reason = decision.reason


def update(
    optimizer: torch.optim.Optimizer,
    rollouts: list[Rollout],
    train: list[torch.Tensor],
    entropies: list[torch.Tensor],
    entropy_coef: float,
) -> float:
    """One AdamW step on the samples MRS kept; returns the loss."""
    losses = [
        (-(rollout.advantage * torch.exp(values - values.detach())) - entropy_coef * entropy).mean()
        for rollout, values, entropy in zip(rollouts, train, entropies, strict=True)
        if rollout.keep
    ]
    optimizer.zero_grad()
    if not losses:
        return 0.0
    loss = torch.stack(losses).mean()
    torch.autograd.backward(loss)
    optimizer.step()
    return float(loss.detach())


def run_step(
    step: int,
    *,
    args: argparse.Namespace,
    client: kforge.Client,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
) -> StepReport:
    """One GRPO step against kforge."""
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(part: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[part] = round(seconds.get(part, 0.0) + now - clock, 3)
        clock = now

    rollouts = start_episodes(client, tokenizer, [name.strip() for name in args.tasks.split(",") if name.strip()], args)
    lap("start")
    model.eval()
    responses = sample(
        model,
        [rollout.prompt_ids for rollout in rollouts],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        eos=int(tokenizer.eos_token_id),
    )
    for rollout, (tokens, logprobs, stopped) in zip(rollouts, responses, strict=True):
        rollout.token_ids, rollout.logprobs = tokens, logprobs
        rollout.finish_reason = "stop" if stopped else "length"
        rollout.text = tokenizer.decode(tokens, skip_special_tokens=True)
    lap("generation")
    step_episodes(client, rollouts)
    lap("evaluation")
    credit(client, rollouts)
    lap("reward")
    model.train()
    train, entropies = recompute(model, rollouts, args.temperature)
    lap("optimiser")
    reject_mismatched(client, rollouts, train)
    lap("reward")
    loss = update(optimizer, rollouts, train, entropies, args.entropy_coef)
    lap("optimiser")

    differences = [
        abs(value - rollout_value)
        for rollout in rollouts
        for value, rollout_value in zip(rollout.train_logprobs, rollout.logprobs, strict=True)
    ]
    return StepReport(
        step=step,
        loss=loss,
        mean_reward=sum(rollout.reward for rollout in rollouts) / len(rollouts),
        policy_gradient=any(rollout.advantage != 0 and rollout.keep for rollout in rollouts),
        kept=sum(rollout.keep for rollout in rollouts),
        mismatch_max_abs=max(differences, default=0.0),
        mismatch_mean_abs=sum(differences) / max(len(differences), 1),
        metrics=job_metrics(client, [rollout.episode_id for rollout in rollouts]),
        seconds=seconds,
        rollouts=rollouts,
    )


def print_step(report: StepReport) -> None:
    """The step's line, and kforge's metrics and the times under it."""
    weights = " ".join(f"{rollout.importance_weight:.6f}" for rollout in report.rollouts)
    driver = "policy gradient + entropy" if report.policy_gradient else "entropy bonus only (all advantages 0)"
    print(
        f"step {report.step}: loss {report.loss:+.6f}  mean reward {report.mean_reward:.4f}  "
        f"rewards {[round(rollout.reward, 4) for rollout in report.rollouts]}  "
        f"advantages {[round(rollout.advantage, 4) for rollout in report.rollouts]}  update: {driver}"
    )
    print("  kforge jobs: " + "  ".join(f"{key} {value:g}" for key, value in report.metrics.items()))
    print(
        f"  MRS: kept {report.kept}/{len(report.rollouts)}  w {weights}  "
        f"|logp_train - logp_rollout| mean {report.mismatch_mean_abs:.2e} max {report.mismatch_max_abs:.2e}"
    )
    print("  seconds: " + "  ".join(f"{part} {value:.2f}" for part, value in report.seconds.items()), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the loop and prints each step."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    model, tokenizer = load(args.model)
    initial = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    load_seconds = time.perf_counter() - started
    print(f"model {args.model.name}: {sum(p.numel() for p in initial.values()):,} parameters, {load_seconds:.1f} s")

    reports: list[StepReport] = []
    with kforge.Client({"orchestrator": args.orchestrator, "reward": args.reward}, timeout=600) as client:
        for step in range(args.steps):
            reports.append(
                run_step(step, args=args, client=client, model=model, tokenizer=tokenizer, optimizer=optimizer)
            )
            print_step(reports[-1])

    changed = sum(
        int(not torch.equal(initial[name], parameter.detach())) for name, parameter in model.named_parameters()
    )
    delta = math.sqrt(
        sum(float((parameter.detach() - initial[name]).pow(2).sum()) for name, parameter in model.named_parameters())
    )
    print(f"weights: {changed}/{len(initial)} tensors changed, L2 of the change {delta:.3e}")
    if args.json:
        summary = {
            "model": str(args.model),
            "args": {key: str(value) for key, value in vars(args).items()},
            "load_seconds": round(load_seconds, 3),
            "total_seconds": round(time.perf_counter() - started, 3),
            "tensors": len(initial),
            "tensors_changed": changed,
            "weight_delta_l2": delta,
            "steps": [asdict(report) for report in reports],
        }
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
