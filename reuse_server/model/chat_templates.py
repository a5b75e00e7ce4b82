"""Chat templates for model files that carry none, by family.

Gemma 3's base GGUF has no tokenizer.chat_template; chat requests are written in Gemma's turn format as the
Gemma 3 instruct template writes it: the assistant's role is "model", contents are trimmed, and a first system
message is folded into the first user turn, followed by a blank line.

Gemma knows only two roles taking turns, user and model, while the conversations coding agents send do not
alternate: Codex sends two `developer` messages before the user's, Claude Code a `system` message in the middle,
and a tool loop answers a model's calls with `tool` messages (often several, then the user's next words). Google's
own template refuses all of these ("roles must alternate"). Ours folds every message that is not the
assistant's into the user turn it stands in, in order, one blank line apart (the separator Google's template puts
after the first system message, so a plain chat renders exactly as Google's does); consecutive assistant messages
share one model turn, a newline apart (as an answer's text and its calls are joined). A mid-conversation system
message thus reads as text of the user turn around it: Gemma has no other place for it, and Google's template
already treats the first one so. Tool definitions, calls and results reach the template as text
(api/tools.py's fallback, which says why the calls keep the Hermes form on Gemma too).

The template is written into a converted model's folder: changing it needs gguf_convert.CONVERTER_VERSION bumped,
so that folders holding the old one are converted again."""

from __future__ import annotations

GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- set turn = namespace(side='') -%}"
    "{%- for message in messages -%}"
    # Google's template keeps a first system message as sent (no trim), and of a list only its first text
    "{%- set as_sent = loop.first and message['role'] == 'system' -%}"
    "{%- if message['content'] is string -%}"
    "{%- set text = message['content'] if as_sent else message['content'] | trim -%}"
    "{%- elif as_sent -%}"
    "{%- set text = message['content'][0]['text'] -%}"
    "{%- else -%}"
    "{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| map('trim') | join('') -%}"
    "{%- endif -%}"
    "{%- set side = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{%- if side != turn.side -%}"
    "{%- if turn.side -%}{{ '<end_of_turn>\n' }}{%- endif -%}"
    "{{ '<start_of_turn>' + side + '\n' }}"
    "{%- set turn.side = side -%}"
    "{%- else -%}"
    "{{ '\n\n' if side == 'user' else '\n' }}"
    "{%- endif -%}"
    "{{ text }}"
    "{%- endfor -%}"
    "{%- if turn.side -%}{{ '<end_of_turn>\n' }}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# GGUF general.architecture -> (the template, the end-of-turn token that also ends generation)
FALLBACKS = {"gemma3": (GEMMA_TURNS, "<end_of_turn>")}
