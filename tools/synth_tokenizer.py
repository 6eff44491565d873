"""Tokenizer files for synthetic checkpoints: a real byte-level BPE (tokenizers library) trained on a small
embedded text, padded with unreachable tokens to exactly the config's vocab_size, with the Nemotron special
tokens at their ids (0 <unk>, 1 <s>, 2 </s>, 10 <|im_start|>, 11 <|im_end|>, 12 <think>, 13 </think>) and a
Nemotron-3-style ChatML chat template (system block always, `enable_thinking`, `truncate_history_thinking`,
`low_effort`, tools in the qwen3_coder XML form)."""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = (["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 10)]
            + ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
               "<tool_response>", "</tool_response>", "<SPECIAL_18>", "<SPECIAL_19>"])

CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few of many small
networks, and only those experts are read from memory. When the model does not fit in the memory of the
graphics card, the experts are streamed from a fast drive into a cache in main memory, and the cache keeps
the experts that were used most recently. Routing is concentrated: a quarter of the experts serves most of
the tokens, so a cache of that size hits four times in five.
TCP is a reliable, connection-oriented protocol: it numbers bytes, acknowledges them and retransmits what was
lost. UDP sends independent datagrams with no delivery guarantee, which suits games, voice and DNS queries.
Question: what is the capital of France? Answer: Paris is the capital of France, and Berlin is the capital
of Germany. The Mamba layer keeps a state that is updated with every token; attention looks back at all
previous tokens; the state space model decays its memory with a learned rate.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

{"name": "get_weather", "arguments": {"city": "London", "unit": "celsius"}}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 2048 4096 65536 3.14159 2.71828.
Привет, как дела? Hallo, wie geht es dir? Bonjour, comment allez-vous? こんにちは。
In the beginning the engine read every expert from the disk, and each token took a long time. Then the
cache grew, the prefetcher guessed the next layer's experts, and the kernel skipped the zero neurons.
"""

CHAT_TEMPLATE = r"""{%- set enable_thinking = enable_thinking if enable_thinking is defined else True -%}
{%- set truncate_history_thinking = truncate_history_thinking if truncate_history_thinking is defined else True -%}
{%- set low_effort = low_effort if low_effort is defined else False -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set system_message = messages[0]['content'] -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system_message = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in loop_messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{- '<|im_start|>system\n' + system_message -}}
{%- if tools -%}
{{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for m in loop_messages -%}
{%- if m['role'] == 'user' -%}
{%- set content = m['content'] -%}
{%- if low_effort and loop.index0 == ns.last_user -%}{%- set content = content + '\n\n{reasoning effort: low}' -%}{%- endif -%}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
{%- elif m['role'] == 'assistant' -%}
{%- set content = m['content'] if m['content'] is string else '' -%}
{%- if m['reasoning_content'] is defined and m['reasoning_content'] -%}
{%- set content = '<think>\n' + m['reasoning_content'] + '\n</think>\n' + content -%}
{%- endif -%}
{%- if '</think>' in content -%}
{%- if truncate_history_thinking and loop.index0 < ns.last_user -%}
{%- set content = '<think></think>' + content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{%- else -%}
{%- set content = '<think></think>' + content -%}
{%- endif -%}
{{- '<|im_start|>assistant\n' + content -}}
{%- if m['tool_calls'] is defined and m['tool_calls'] -%}
{%- for tc in m['tool_calls'] -%}
{%- set f = tc['function'] if tc['function'] is defined else tc -%}
{{- '\n<tool_call>\n<function=' + f['name'] + '>\n' -}}
{%- if f['arguments'] is mapping -%}
{%- for k, v in f['arguments'].items() -%}
{{- '<parameter=' + k + '>\n' + (v if v is string else (v | tojson)) + '\n</parameter>\n' -}}
{%- endfor -%}
{%- endif -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif m['role'] == 'tool' -%}
{%- if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + m['content'] + '\n</tool_response>' -}}
{%- if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{%- if enable_thinking -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- else -%}{{- '<|im_start|>assistant\n<think></think>' -}}{%- endif -%}
{%- endif -%}"""


def build_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIALS) + len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} < {len(SPECIALS) + len(alphabet)} (specials + 256 bytes)")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    for i, s in enumerate(SPECIALS):
        assert vocab[s] == i, (s, vocab.get(s))
    n = len(vocab)
    for k in range(n, vocab_size):  # unreachable filler: no merge produces these strings
        vocab[f"<|reserved_{k}|>"] = k
    for a in d["added_tokens"]:
        a["special"] = True
    return json.dumps(d, ensure_ascii=False)


def write_tokenizer(out: Path, vocab_size: int) -> None:
    write_tokenizer_files(out, build_tokenizer_json(vocab_size))


def write_tokenizer_files(out: Path, tokenizer_json: str) -> None:
    """tokenizer.json as given, and the tokenizer_config.json (specials, chat template) every checkpoint here has."""
    out = Path(out)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, s in enumerate(SPECIALS)}
    cfg = {
        "add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": added,
        "bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<unk>",
        "clean_up_tokenization_spaces": False, "model_max_length": 262144,
        "tokenizer_class": "PreTrainedTokenizerFast", "tool_parser_type": "qwen3_coder",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<unk>"}, indent=2) + "\n")
