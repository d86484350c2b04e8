"""Making a request: validate its parameters against this engine and model, tokenize
its prompt, bound its output, and make its choices (n > 1). Touches no engine state, so
any thread may do it (AsyncEngine does it off the event loop for large prompts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.engine_request import EngineRequest
from app.engine.errors import BadParameter, ContextTooLong
from app.engine.request import Request, SamplingParams
from app.engine.structured import GrammarCompiler


@dataclass
class RequestMaker:
    """What a request is checked against: the tokenizer, the vocabulary, the context limit,
    the KV cache's capacity in tokens and the batch's width."""

    tokenizer: object
    vocab_size: int
    max_model_len: int
    capacity_tokens: int
    max_num_seqs: int
    eos_token_ids: frozenset[int]
    grammars: GrammarCompiler

    def make(self, asked: EngineRequest) -> Request:
        """Validate and tokenize; touches no engine state, so any thread may call it.
        Raises BadParameter (ContextTooLong for a prompt that does not fit) with a
        message fit for the user. With params.n > 1 the request is choice 0 and carries
        the others in `forks`."""
        prompt, params, session_id = asked.prompt, asked.params, asked.session_id
        self._check_params(params, session_id)
        if any(t >= self.vocab_size for t in asked.replay_ids):
            raise BadParameter(f"replay_ids must be below {self.vocab_size}", "replay_ids")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            token_ids = list(prompt)
            vocab = self.vocab_size
            if any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                for t in token_ids
            ):
                raise BadParameter(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if not token_ids:
            raise BadParameter("the prompt is empty", "prompt")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ContextTooLong(
                f"the prompt is {n} tokens long; this model's context limit is "
                f"{self.max_model_len} tokens, including at least one generated token",
                n,
                self.max_model_len,
            )
        capacity = self.capacity_tokens
        if n >= capacity:
            raise ContextTooLong(
                f"the prompt is {n} tokens long; the KV cache holds only {capacity} tokens",
                n,
                capacity,
            )
        # One request never outgrows the context or the whole cache: that would preempt
        # itself forever. It stops with finish_reason "length" instead.
        room = min(self.max_model_len, capacity) - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.max_tokens == 0:
            max_tokens = 0  # scoring: the prompt's logprobs, nothing generated
        # Scoring a prompt needs logits at its every token: none may come from the cache.
        use_prefix_cache = asked.use_prefix_cache and params.prompt_logprobs is None
        request_id, cache_salt = asked.request_id, asked.cache_salt
        req = self._choice(request_id, 0, token_ids, params, max_tokens, session_id,
                           use_prefix_cache, cache_salt)  # fmt: skip
        req.replay_ids = asked.replay_ids
        if params.response_format is not None:
            req.grammar = self.grammars.compile(params.response_format, req.stop_token_ids)
        for i in range(1, params.n):
            child = self._choice(f"{request_id}#{i}", i, token_ids, params.for_choice(i),
                                 max_tokens, None, True, cache_salt)  # fmt: skip
            child.group_id = request_id
            child.grammar = req.grammar.fork() if req.grammar is not None else None
            req.forks.append(child)
        if asked.seed_offset and params.seed is not None:
            for choice in (req, *req.forks):
                # The sampler draws one number per sampled token (app.engine.sampler), and n
                # numbers drawn at once advance the generator exactly as n single draws do.
                torch.rand(asked.seed_offset, generator=choice.generator)
        return req

    def _check_params(self, params: SamplingParams, session_id: str | None) -> None:
        """What SamplingParams cannot check alone: limits of this engine and model."""
        seqs = self.max_num_seqs
        if params.n > seqs:
            raise BadParameter(f"n is limited to {seqs} here (max_num_seqs)", "n")
        if params.n > 1 and session_id is not None:
            raise BadParameter("n > 1 does not combine with a conversation's session", "n")
        if params.n > 1 and params.max_tokens == 0:
            raise BadParameter("n > 1 needs max_tokens of at least 1", "n")
        vocab = self.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise BadParameter(f"logit_bias token ids must be below {vocab}", "logit_bias")

    def _choice(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        session_id: str | None,
        use_prefix_cache: bool,
        cache_salt: str | None,
    ) -> Request:
        req = Request(request_id, token_ids, params, max_tokens, self.eos_token_ids,
                      session_id, use_prefix_cache, cache_salt)  # fmt: skip
        req.index = index
        req.detokenizer = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.skip_special_tokens
        )
        return req
