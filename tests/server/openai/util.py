"""What the OpenAI client tests here say to the server."""

MODEL = "SmolLM2-135M-Instruct"


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
