"""The data contract: every TensorDict key tokengym reads or writes, with its dtype and shape.

This module is the only place a key string is typed out; everything else imports the names.
Keys follow TorchRL 0.14 defaults so ``ClipPPOLoss``, ``GAE`` and ``GRPOLoss`` work unchanged.

Shapes (``B`` parallel slots or sequences, ``T`` steps/tokens, ``L`` padded sequence length):

=========================  =======  ==========  =============================================
key                        dtype    shape       meaning
=========================  =======  ==========  =============================================
TOKEN                      int64    (B,)        last token of the sequence so far (policy input)
SEQ_LEN                    int64    (B,)        tokens in the sequence so far (prompt+response)
PROMPT_LEN                 int64    (B,)        tokens in the prompt (incl. env-inserted turns)
RESPONSE_LEN               int64    (B,)        tokens generated so far in this trajectory
TRAJ_ID                    int64    (B,)        trajectory id, unique per env
GROUP_ID                   int64    (B,)        prompt (group) id; ``group_size`` samples share it
SAMPLE_ID                  int64    (B,)        index of the sample within its group
TURN                       int64    (B,)        turn index (0 for single-turn)
ACTIVE                     bool     (B,)        slot holds a live trajectory (False once the
                                                prompt source is exhausted)
ACTION                     int64    (B,)        the token chosen
ACTION_LOG_PROB            float32  (B,)        its log-prob under the sampling distribution
RAW_LOG_PROB               float32  (B,)        its log-prob under the model (temperature 1)
TRAINER_LOG_PROB           float32  (B,)        its log-prob under the trainer at the training step's
                                                start (MismatchCorrection; decoupled PPO's old log-prob)
POLICY_VERSION             int64    (B,)        version of the policy that chose the token
REWARD                     float32  (B, 1)      reward, nonzero at a trajectory's last step
DONE/TERMINATED/TRUNCATED  bool     (B, 1)      done = terminated | truncated
STATE_VALUE                float32  (B, 1)      critic value
ADVANTAGE                  float32  (B, 1)      advantage estimate
VALUE_TARGET               float32  (B, 1)      return target for the critic
REWARD_RAW / REWARD_KL     float32  (B, 1)      task reward before KL shaping / the KL penalty
REF_LOG_PROB               float32  (B,)        reference-model log-prob of the action
KL                         float32  (B,)        per-token KL estimate
MASK                       bool     (B,)        collector: valid step (padding is False)
PARENT_ID                  int64    (B,)        trees: the trajectory a branch forked from (-1: a root)
FORK_INDEX                 int64    (B,)        trees: the step where a branch left its parent (0: a root)
BRANCH_ID                  int64    (B,)        trees: the trajectory that generated the step's token
=========================  =======  ==========  =============================================
"""

from __future__ import annotations

import torch
from torchrl.data import Bounded, Categorical, Composite, Unbounded

# -- observation (what a policy needs to continue a sequence; O(1) in its length) --
TOKEN = "token"
SEQ_LEN = "seq_len"
PROMPT_LEN = "prompt_len"
RESPONSE_LEN = "response_len"

# -- provenance --
TRAJ_ID = "traj_id"
GROUP_ID = "group_id"
SAMPLE_ID = "sample_id"
TURN = "turn"
ACTIVE = "active"
POLICY_VERSION = "policy_version"

# -- action (torchrl defaults) --
ACTION = "action"
ACTION_LOG_PROB = "action_log_prob"
RAW_LOG_PROB = "raw_log_prob"

# -- outcome (torchrl nested-key convention) --
REWARD = ("next", "reward")
DONE = ("next", "done")
TERMINATED = ("next", "terminated")
TRUNCATED = ("next", "truncated")

# -- written by transforms and losses --
STATE_VALUE = "state_value"
ADVANTAGE = "advantage"
VALUE_TARGET = "value_target"
REWARD_RAW = ("next", "reward_raw")
REWARD_KL = ("next", "reward_kl")
REF_LOG_PROB = "ref_log_prob"
KL = "kl"

# -- written by the collector --
MASK = ("collector", "mask")
NEXT = "next"  # the sub-TensorDict of a step's outcome
RESET = "_reset"  # bool (B, 1) torchrl partial-reset mask
LOGITS = "logits"  # float32 (N, T, V) per-step logits written by SequenceActor
PROMPTS = ("collector", "prompts")
VERSION_START = ("collector", "version_start")  # int64 (N, T) policy version of the trajectory's first token
VERSION_END = ("collector", "version_end")  # int64 (N, T) policy version of its last token

# -- trees (branching rollouts): a leaf's row holds its whole sequence; the steps before its fork are its ancestors' --
PARENT_ID = "parent_id"  # int64 (N, T) per row: the trajectory the leaf forked from (-1: the tree's root)
FORK_INDEX = "fork_index"  # int64 (N, T) per row: the step where it left its parent (its steps before it are copies)
BRANCH_ID = "branch_id"  # int64 (N, T) per step: the trajectory that generated the step's token (shared steps: an ancestor's)

# -- sequence-level (padded) layout, batch (N,) over sequences, L positions --
# TorchRL's LLM layout (``torchrl.objectives.llm.GRPOLoss`` reads these by default)
TOKENS = ("tokens", "full")  # int64 (N, L) left-padded prompt + right-padded response
LOG_PROBS = ("log_probs", "full")  # float32 (N, L) sampling log-prob of each generated token, 0 elsewhere
REF_LOG_PROBS = ("next", "ref_log_probs", "full")  # float32 (N, L) reference log-prob of each generated token
ATTENTION_MASK = "attention_mask"  # bool (N, L)
ACTION_MASK = "action_mask"  # bool (N, L) True on tokens the policy generated
POSITION_IDS = "position_ids"  # int64 (N, L) / packed (1, sum L)
SEQ_OFFSETS = "offsets"  # int64 (N+1,) packed layout boundaries
# transforms (issue #4): layout position, DPO pairs, per-token loss weights
RESPONSE_START = "response_start"  # int (non-tensor) padded layout: column of the first response token
CHOSEN = "chosen"  # sub-TensorDict (G, L) DPO pairs: the higher-reward sequence of a group
REJECTED = "rejected"  # sub-TensorDict (G, L) DPO pairs: the lower-reward sequence of a group
LOSS_WEIGHT = "loss_weight"  # float32 (B,) per-token loss weight (clip-filter / dynamic sampling)
# mismatch correction (issue #24): the trainer's teacher-forced log-prob of each action at the training step's start
TRAINER_LOG_PROB = "trainer_log_prob"  # float32 (B,) written by MismatchCorrection; the decoupled PPO ratio's old log-prob

# the outcome keys' names inside a step's "next" TensorDict, where the env writes them
REWARD_NAME, DONE_NAME, TERMINATED_NAME, TRUNCATED_NAME = REWARD[1], DONE[1], TERMINATED[1], TRUNCATED[1]

OBSERVATION_KEYS = (TOKEN, SEQ_LEN, PROMPT_LEN, RESPONSE_LEN, TRAJ_ID, GROUP_ID, SAMPLE_ID, TURN, ACTIVE)
PROVENANCE_KEYS = (TRAJ_ID, GROUP_ID, SAMPLE_ID, TURN, POLICY_VERSION)
DONE_KEYS = (DONE_NAME, TERMINATED_NAME, TRUNCATED_NAME)


def make_spec(batch_size: int, vocab_size: int, max_length: int) -> dict[str, Composite]:
    """Build the observation, action, reward and done specs of a token env, all in one place.

    Args:
        batch_size: number of parallel slots ``B``.
        vocab_size: number of token ids; actions lie in ``[0, vocab_size)``.
        max_length: capacity of the sequence buffer (prompt + response).

    Example:
        >>> specs = make_spec(4, vocab_size=100, max_length=32)
        >>> specs["action"].shape, specs["observation"]["token"].dtype
        (torch.Size([4]), torch.int64)
    """
    shape = torch.Size([batch_size])
    i64 = {"shape": shape, "dtype": torch.int64}
    length = {"low": 0, "high": max_length, **i64}
    observation = Composite(
        {
            TOKEN: Bounded(low=0, high=vocab_size - 1, **i64),
            SEQ_LEN: Bounded(**length),
            PROMPT_LEN: Bounded(**length),
            RESPONSE_LEN: Bounded(**length),
            TRAJ_ID: Unbounded(**i64),
            GROUP_ID: Unbounded(**i64),
            SAMPLE_ID: Unbounded(**i64),
            TURN: Unbounded(**i64),
            ACTIVE: Categorical(2, shape=shape, dtype=torch.bool),
        },
        shape=shape,
    )
    done_one = Categorical(2, shape=(batch_size, 1), dtype=torch.bool)
    return {
        "observation": observation,
        ACTION: Categorical(vocab_size, shape=shape, dtype=torch.int64),
        REWARD_NAME: Unbounded(shape=(batch_size, 1), dtype=torch.float32),
        DONE_NAME: Composite(
            {name: done_one.clone() for name in DONE_KEYS},
            shape=shape,
        ),
    }
