"""LLM: the offline API. Give it prompts, get completions; the engine batches them.

    from app.llm import LLM
    from app.engine.request import SamplingParams
    llm = LLM()
    print(llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0))[0].text)

It sits above the engine and beside the server, and builds chat prompts with the same
ChatPrompt as /ws and /v1 (app.chat.prompt), so a conversation gives the same tokens
whichever door it comes through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from app.chat.prompt import ChatPrompt, Message
from app.config import EngineConfig, ModelConfig
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import FinishReason, SamplingParams, Timings
from app.model.loader import LoadedModel

Prompt = str | Sequence[int]
Messages = Sequence[Message | dict[str, str]]


@dataclass
class Completion:
    """A finished generation."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    timings: Timings | None = None


class LLM:
    """Synchronous batch generation over one LLMEngine."""

    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        if config is None:
            config = EngineConfig(model=ModelConfig(model=model))
        self.engine = LLMEngine(config, loaded)
        self.tokenizer = self.engine.tokenizer
        self.prompt = ChatPrompt(self.tokenizer)

    def chat_prompt(self, messages: Messages) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the
        assistant's reply."""
        return self.prompt.render(
            [m if isinstance(m, Message) else Message(m["role"], m["content"]) for m in messages]
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt at once; results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, Completion] = {}
        order = []
        for prompt, p in zip(prompts, params, strict=True):
            req = self.engine.add_request(EngineRequest(prompt, p))
            results[req.request_id] = Completion(req.request_id, list(req.prompt_token_ids))
            order.append(req.request_id)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                c = results[out.request_id]
                c.text += out.new_text
                c.token_ids.extend(out.new_token_ids)
                if out.finished:
                    c.finish_reason = out.finish_reason
                    c.cached_tokens = out.cached_tokens
                    c.timings = out.timings
        return [results[i] for i in order]

    def chat(
        self,
        conversations: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Like generate(), for chat message lists."""
        if conversations and isinstance(conversations[0], (dict, Message)):
            conversations = [conversations]  # type: ignore[list-item]
        return self.generate([self.chat_prompt(m) for m in conversations], params)  # type: ignore[arg-type]
