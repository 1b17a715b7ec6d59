"""Images in requests: loading them from the values clients send (``media``) and finding them in
chat messages and the other APIs' content blocks (``chat_parts``).

The front end turns a conversation with images into vLLM's prompt form, ``{"prompt": <the
chat template's text, the model's image placeholder once per image>, "multi_modal_data":
{"image": [PIL.Image, ...]}}``, and hands that to the engine through the same entry as a text
prompt (``InputProcessor.tokenize`` offline, ``AsyncEngine.tokenize_prompt`` in the server).
"""
