"""Tool calls beyond the head's request handling (``meshnet_node.head.tools``): the parsers
of the formats models write calls in (``tool_choice: "auto"``: Hermes, Llama 3 JSON, Mistral,
gpt-oss harmony, DeepSeek V3), the choice among them from the chat template, and the strict
argument schemas forced calls are constrained by."""
