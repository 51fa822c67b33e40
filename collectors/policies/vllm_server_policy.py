"""VLLMServerPolicy: whole waves generated on running vLLM servers (OpenAI-compatible HTTP), token ids in and out.

:class:`~tokengym.collectors.policies.ServerPolicy` with vLLM's server dialect
(:class:`~._vllm_dialect.VLLMServerDialect`): the same per-request seeds, sampling fields, termination (the env's EOS
ids as ``stop_token_ids`` with ``ignore_eos``, the env's stop strings, budgets clamped here) and log-prob semantics
(processed log-probs) as :class:`~tokengym.collectors.policies.vllm_policy.VLLMPolicy`, on a fleet of servers.
"""

from __future__ import annotations

from tokengym.collectors.policies._server_options import NoServerError, ServerOptions
from tokengym.collectors.policies._vllm_dialect import VLLMServerDialect
from tokengym.collectors.policies.server_policy import ServerPolicy

__all__ = ["NoServerError", "ServerOptions", "VLLMServerPolicy"]


class VLLMServerPolicy(ServerPolicy):
    """Generates every live slot's turn of a :class:`~tokengym.llm_envs.TokenEnv` on running vLLM servers.

    A :class:`~tokengym.collectors.policies.ServerPolicy` whose dialect is vLLM's (one ``/v1/completions`` request per
    slot, weights reloaded through ``/collective_rpc``, requests aborted by id through ``/abort_requests``, weights
    tagged with vLLM's weight version); its arguments, routing, failover, partial rollouts and weight updates are
    ``ServerPolicy``'s.

    Raises:
        ValueError: besides ``ServerPolicy``'s: a server reports log-probs that would not be those of the
            distribution sampled from (start it with ``--logprobs-mode processed_logprobs``); an HTTP server is not
            vLLM; the served model has a head size vLLM's CPU attention cannot run (its engine would die at the first
            request; on CPU ``tokengym.testing.tiny_model(tok, size="small")`` serves); a server's engine died (its log
            is named when this process started it with ``LocalVLLMServer``).

    Warns:
        UserWarning: the policy has a key but a server answers its development endpoints without one (anyone
            who can reach it can replace its weights).

    Example (not run here: see :class:`~tokengym.collectors.policies.LocalVLLMServer` to start a server)::

        policy = VLLMServerPolicy(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], env,
                                  options=ServerOptions(weights_dir="/shared/weights/run-17", api_key=key))
        collector = TokenCollector(env, policy, mode="trajectories", batch_size=64, source="wave")
        for batch in collector:
            ...  # train
            collector.update_policy_weights_(model.state_dict())  # written once, reloaded into every server
    """

    dialect = VLLMServerDialect()
    """What is vLLM's own: request and answer fields, endpoints, start-up checks, weight reload, cache reset, abort
    (a ``FleetDialect``; see "Writing an engine dialect" in the backends guide)."""
