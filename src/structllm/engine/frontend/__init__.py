"""The front end: ``AsyncLLM`` and what it is made of, in the caller's process.

Split by job as vLLM v1 splits it: :mod:`.async_llm` (the public API),
:mod:`.request_stream` (one request's block), :mod:`.inputs` (what a caller
passes, checked, and the request the core takes), :mod:`.output_processor`
(tokens to outputs, per-request mailboxes), :mod:`.replicas` (the data
parallel set of cores and the one relay of their events), :mod:`.routing`
(which replica a request goes to), :mod:`.core_client` (start, supervise
and talk to one core) and :mod:`.core_connection` (its process or thread,
handshake, frames).
"""
