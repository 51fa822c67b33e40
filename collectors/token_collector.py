"""TokenCollector: drives a policy through a TokenEnv and yields fixed-step batches or finished trajectories."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from enum import StrEnum

import torch
from tensordict import TensorDict, TensorDictBase

from tokengym.collectors._recorders import StepKeys, StepRecorder, TrajectoryRecorder, to_tensordict
from tokengym.llm_envs import PromptTable, TokenEnv, keys

__all__ = ["CollectMode", "TokenCollector"]


class CollectMode(StrEnum):
    """What one yielded batch holds.

    ``STEPS``: ``steps_per_batch`` env steps of every slot, shape (B, T); a trajectory may span
    batches and keeps its id. ``TRAJECTORIES``: ``batch_size`` finished trajectories, shape (N, T),
    right-padded (``keys.MASK`` marks real steps).
    """

    STEPS = "steps"
    TRAJECTORIES = "trajectories"


def _base_env(env):
    return getattr(env, "base_env", env)


class TokenCollector:
    """Collects token-level rollouts from ``env`` with ``policy``.

    Args:
        env: a :class:`~tokengym.llm_envs.TokenEnv` (or a ``TransformedEnv`` of one).
        policy: e.g. :class:`~tokengym.collectors.TransformersPolicy`; writes ``action`` and log-probs.
        mode: a :class:`CollectMode` or its string.
        batch_size: env steps per batch (``STEPS``) or trajectories per batch (``TRAJECTORIES``).
        total_steps: stop after this many env steps (each is ``B`` tokens); -1 runs until the
            prompt source is exhausted (forever for a repeating source).
        postproc: a callable applied to every batch (e.g. a KL transform); if it has ``metrics()``,
            they join the batch metrics.
        sink: a TorchRL ``ReplayBuffer`` (``extend``) or a queue (``put``): batches go there and
            iteration yields ``None``.
        is_last_step_only: in ``TRAJECTORIES`` mode, keep only each trajectory's last step (N,).
        use_progress_bar: show a tqdm bar of collected steps.

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.collectors import TransformersPolicy
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> env = TokenEnv(["1+1=", "2+3="], tok, batch_size=2, max_new_tokens=4, model_config=model.config)
        >>> collector = TokenCollector(env, TransformersPolicy(model, env), mode="steps", batch_size=3, total_steps=6)
        >>> [tuple(batch.shape) for batch in collector]
        [(2, 3), (2, 3)]
    """

    def __init__(
        self,
        env,
        policy: Callable[[TensorDictBase], TensorDictBase],
        *,
        mode: CollectMode | str = CollectMode.STEPS,
        batch_size: int,
        total_steps: int = -1,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        sink=None,
        is_last_step_only: bool = False,
        use_progress_bar: bool = False,
    ) -> None:
        self.mode = _check_mode(mode)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            what = "steps_per_batch (env steps)" if self.mode is CollectMode.STEPS else "trajectories per batch"
            raise ValueError(f"batch_size ({what}) must be a positive int, got {batch_size!r}")
        if not isinstance(total_steps, int) or (total_steps <= 0 and total_steps != -1):
            raise ValueError(f"total_steps must be a positive int or -1 (endless), got {total_steps!r}")
        if is_last_step_only and self.mode is not CollectMode.TRAJECTORIES:
            raise ValueError("is_last_step_only=True needs mode='trajectories' (a step batch has no 'last step')")
        if sink is not None and not (hasattr(sink, "extend") or hasattr(sink, "put")):
            raise TypeError(f"sink must be a ReplayBuffer (extend) or a queue (put), got {type(sink).__name__}")
        if postproc is not None and not callable(postproc):
            raise TypeError(f"postproc must be callable on a TensorDict, got {postproc!r}")
        base = _base_env(env)
        if not isinstance(base, TokenEnv):
            raise TypeError(f"env must be a TokenEnv or a TransformedEnv of one, got {type(base).__name__}")
        self.env, self.base_env, self.policy = env, base, policy
        self.batch_size, self.total_steps, self.postproc, self.sink = batch_size, total_steps, postproc, sink
        self.is_last_step_only, self.use_progress_bar = is_last_step_only, use_progress_bar
        self._is_fast = env is base  # a bare TokenEnv skips EnvBase.step's generic checks
        self.steps_done, self._obs, self.metrics = 0, None, {}
        self._prompts = PromptTable()
        self._step_keys = StepKeys()
        self._new_recorder()

    def _new_recorder(self) -> None:
        if self.mode is CollectMode.STEPS:
            self._rec: StepRecorder | TrajectoryRecorder = StepRecorder(self.batch_size)
        else:
            self._rec = TrajectoryRecorder(self.base_env.max_new_tokens)

    # -- stepping --
    def _remember_prompts(self, slots) -> None:
        for b in slots:
            prompt = self.base_env.slot_prompt(b)
            if prompt is not None:
                self._prompts.add(prompt.group_id, prompt.ids, text=prompt.text, metadata=prompt.metadata)

    def _start(self) -> None:
        self._obs = self.env.reset()
        self._remember_prompts(range(self.base_env.batch_size[0]))

    def _step(self) -> dict:
        td = self.policy(self._obs)
        if self._is_fast:
            nxt = self.env._step(td)
            done = nxt.get(keys.DONE[1])
            if bool(done.any()):
                self._obs = self.env._reset(TensorDict({keys.RESET: done}, self.env.batch_size))
                self._remember_prompts(done.reshape(-1).nonzero().squeeze(-1).tolist())
            else:
                self._obs = nxt
        else:
            out, self._obs = self.env.step_and_maybe_reset(td)
            nxt = out.get(keys.NEXT)
            done = nxt.get(keys.DONE[1])
            if bool(done.any()):
                self._remember_prompts(done.reshape(-1).nonzero().squeeze(-1).tolist())
        self.steps_done += 1
        self._take_sequences()
        return self._step_keys.flat(td, nxt)

    def _take_sequences(self) -> None:
        """Move the full sequences of finished multi-turn episodes into the prompt table."""
        finished = getattr(self.base_env, "finished_sequences", None)
        while finished:
            traj, ids = finished.popitem()
            self._prompts.add_sequence(traj, ids)

    def _has_budget(self) -> bool:
        return self.total_steps == -1 or self.steps_done < self.total_steps

    # -- batches --
    def _next_batch(self) -> TensorDictBase | None:
        """Step until a batch is full; ``None`` when the budget or the prompt source runs out."""
        if self._obs is None:
            self._start()
        start, steps0 = time.perf_counter(), self.steps_done
        while not self._is_full():
            if not self._has_budget() or self.base_env.is_exhausted:
                return self._flush()
            self._collect_some()
        return self._finish(self._pop(), start, steps0)

    def _collect_some(self) -> None:
        """Advance the env (one step here; a wave in generate-then-unroll) and record it."""
        self._rec.write(self._wrap(self._step()))

    def _wrap(self, flat: dict) -> dict:
        if self.mode is CollectMode.STEPS:
            return {k: v.unsqueeze(1) for k, v in flat.items()}  # one column
        return flat

    def _is_full(self) -> bool:
        if self.mode is CollectMode.STEPS:
            return self._rec.free == 0
        return len(self._rec.finished) >= self.batch_size

    def _flush(self) -> TensorDictBase | None:
        """A last, shorter batch: the steps or finished trajectories collected before the end."""
        if self.mode is CollectMode.STEPS and self._rec.t > 0:
            self._rec.truncate()
            return self._finish(self._pop(), time.perf_counter(), self.steps_done)
        if self.mode is CollectMode.TRAJECTORIES and self._rec.finished:
            return self._finish(self._rec.pop(len(self._rec.finished)), time.perf_counter(), self.steps_done)
        return None

    def _pop(self) -> dict:
        if self.mode is CollectMode.STEPS:
            flat = self._rec.pop()
            flat["collector.mask"] = flat[keys.ACTIVE].clone()
            return flat
        return self._rec.pop(self.batch_size)

    def _finish(self, flat: dict, start: float, steps0: int) -> TensorDictBase:
        batch = to_tensordict(flat, flat[keys.ACTION].shape[:2])
        batch = self._add_provenance(batch)
        if self.postproc is not None:
            batch = self.postproc(batch)
        self._update_metrics(batch, time.perf_counter() - start, steps0)
        return batch

    def _add_provenance(self, batch: TensorDictBase) -> TensorDictBase:
        mask = batch.get(keys.MASK)
        groups = batch.get(keys.GROUP_ID)[mask].unique()
        trajs = batch.get(keys.TRAJ_ID)[mask].unique()
        batch.set_non_tensor(keys.PROMPTS, self._prompts.subset(groups, trajs))
        self._prune_prompts()
        if self.mode is CollectMode.TRAJECTORIES:
            version = batch.get(keys.POLICY_VERSION)
            last = mask.sum(1, keepdim=True) - 1  # (N, 1) index of each last step
            batch.set(keys.VERSION_START, version[:, :1].expand_as(version).clone())
            batch.set(keys.VERSION_END, version.gather(1, last).expand_as(version).clone())
            if self.is_last_step_only:
                batch = batch[torch.arange(batch.shape[0]), last.squeeze(1)]
        return batch

    def _prune_prompts(self) -> None:
        """Keep only prompts still referenced by live slots or queued trajectories (bounded memory)."""
        live = [p.group_id for b in range(self.base_env.batch_size[0]) if (p := self.base_env.slot_prompt(b))]
        if isinstance(self._rec, TrajectoryRecorder):
            live += [int(row[keys.GROUP_ID][0]) for row, _ in self._rec.finished]
        queued = [int(row[keys.TRAJ_ID][0]) for row, _ in getattr(self._rec, "finished", [])]
        self._prompts = self._prompts.subset(torch.tensor(live, dtype=torch.int64), queued)

    def _update_metrics(self, batch: TensorDictBase, elapsed: float, steps0: int) -> None:
        mask = batch.get(keys.MASK) if not self.is_last_step_only else torch.ones(batch.shape, dtype=torch.bool)
        done = batch.get(keys.DONE).squeeze(-1) & mask
        n_done = int(done.sum())
        reward = batch.get(keys.REWARD_RAW if keys.REWARD_RAW in batch.keys(True) else keys.REWARD).squeeze(-1)
        resp = batch.get((keys.NEXT, keys.RESPONSE_LEN))
        tokens = int(mask.sum())
        self.metrics = {
            "tokens": tokens,
            "tokens_per_s": tokens / max(elapsed, 1e-9),
            "finished": n_done,
            "mean_reward": float(reward[done].mean()) if n_done else float("nan"),
            "mean_response_len": float(resp[done].float().mean()) if n_done else float("nan"),
            "policy_version": int(getattr(self.policy, "version", 0)),
            "steps": self.steps_done,
        }
        extra = getattr(self.postproc, "metrics", None)
        if callable(extra):
            self.metrics.update(extra())

    # -- iteration --
    def __iter__(self) -> Iterator[TensorDictBase | None]:
        bar = self._progress_bar()
        while (batch := self._next_batch()) is not None:
            if bar is not None:
                bar.update(self.metrics["tokens"])
                bar.set_postfix(reward=f"{self.metrics['mean_reward']:.3f}", tok_s=f"{self.metrics['tokens_per_s']:.0f}")
            if self.sink is None:
                yield batch
                continue
            (self.sink.extend if hasattr(self.sink, "extend") else self.sink.put)(batch)
            yield None
        if bar is not None:
            bar.close()

    def _progress_bar(self):
        if not self.use_progress_bar:
            return None
        from tqdm.auto import tqdm

        total = None if self.total_steps == -1 else self.total_steps * self.base_env.batch_size[0]
        return tqdm(total=total, unit="tok", desc="collecting")

    def update_policy_weights_(self, state_dict: dict | None = None) -> int:
        """Load new weights into the policy's model (if given) and bump the policy version."""
        if state_dict is not None:
            self.policy.model.load_state_dict(state_dict)
        if hasattr(self.policy, "reset_cache"):
            self.policy.reset_cache()  # live slots are re-prefilled under the new weights
        return self.policy.bump_version()

    # -- checkpoints --
    def state_dict(self) -> dict:
        """Everything needed to resume between batches: env, sampling RNG, version, unfinished steps.

        A postproc with state of its own (a KL controller, say) is checkpointed by its own ``state_dict``.
        """
        return copy.deepcopy({
            "env": self.base_env.state_dict(),
            "policy": self.policy.state_dict_rng(),
            "obs": None if self._obs is None else self._obs.clone(),
            "steps_done": self.steps_done,
            "recorder": self._rec.state_dict() if isinstance(self._rec, TrajectoryRecorder) else None,
            "prompts": self._prompts,
        })  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the next batch is the one the saved run would have yielded."""
        self.base_env.load_state_dict(state["env"])
        self.policy.load_state_dict_rng(state["policy"])
        self._obs, self.steps_done = state["obs"], state["steps_done"]
        self._new_recorder()
        if state["recorder"] is not None:
            self._rec.load_state_dict(state["recorder"])
        self._prompts = state["prompts"]


def _check_mode(mode) -> CollectMode:
    try:
        return CollectMode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of {[m.value for m in CollectMode]}, got {mode!r}") from None
