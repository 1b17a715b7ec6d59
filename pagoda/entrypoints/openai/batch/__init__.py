"""OpenAI's Files and Batch API: JSONL request files in, JSONL result files out, each line run
through the server's own routes at the batch class's priority (see ``runner``)."""
