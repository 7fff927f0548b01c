"""The OpenAI API as a service over an engine client, free of any transport: admission, running, and the
bodies of responses and streamed chunks. The HTTP server and the batch runners both call it."""
