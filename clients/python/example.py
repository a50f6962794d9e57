"""Stream a completion from a running lucekv server (start one with `lucekv serve` or `make serve`).

usage: python clients/python/example.py ["PROMPT"] [ADDRESS]
"""

import sys

import grpc

from lucekv.client import DEFAULT_ADDRESS, Client, SamplingOptions


def main() -> int:
    prompt = sys.argv[1] if len(sys.argv) > 1 else "Write a haiku about the sea."
    address = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_ADDRESS
    with Client(address) as client:
        try:
            info = client.server_info(timeout=10)
            print(f"{info.model_name} ({info.arch}, {info.backend}) at {address}", file=sys.stderr)
            chat = "chat_template" in info.features
            request = [{"role": "user", "content": prompt}] if chat else prompt
            for chunk in client.generate(request, SamplingOptions(max_tokens=128, temperature=0.7, seed=1)):
                print(chunk.text, end="", flush=True)
            usage = chunk.usage
            print(
                f"\n[{usage.completion_tokens} tokens, first after {usage.time_to_first_token_ms:.0f} ms, "
                f"{usage.decode_tokens_per_second:.1f} tok/s]",
                file=sys.stderr,
            )
        except grpc.RpcError as e:
            print(f"lucekv: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
