"""Text in and out: tokenizer, detokenizer, chat templates, tool calls, infill, grammars."""
