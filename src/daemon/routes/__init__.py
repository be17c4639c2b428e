"""The daemon's API routes, one module per surface, and their table (``API_ROUTES``).

- ``openai_api``: /v1/models, /v1/chat/completions, /v1/completions (OpenAI's text API)
- ``responses_api``: /v1/responses (OpenAI's Responses API, served as chat; stored responses)
- ``retrieval_api``: /v1/embeddings, /v1/rerank
- ``tokenizer_api``: /tokenize, /detokenize (vLLM's)
- ``collection_api``: /v1/collections and their documents
- ``engine_api``: PATCH /v1/engines/{engine}
- ``session_api``: /v1/sessions, their variables and calls (Parrot's semantic variables)
- ``workflow_api``: /v1/workflows and /v1/runs

Each handler reaches the daemon's parts through ``headrace.daemon.services``: ``daemon(request)`` (the
composed ``Daemon``: pool, workflows, sessions...) and ``services(request)`` (what the HTTP daemon adds).
The probes, /metrics and the API's own documents (/openapi.json, /docs) are the app's (``app.py``).
"""

from __future__ import annotations

from starlette.routing import Route

from headrace.daemon.routes.collection_api import (add_documents, create_collection, delete_collection,
                                                   delete_document, get_collection, list_collections)
from headrace.daemon.routes.engine_api import update_engine
from headrace.daemon.routes.openai_api import chat_completions, completions, get_model, list_models
from headrace.daemon.routes.responses_api import create_response, delete_response, get_response, list_input_items
from headrace.daemon.routes.retrieval_api import embeddings, rerank
from headrace.daemon.routes.session_api import (create_call, create_session, create_variable, delete_session,
                                                get_session, get_variable, set_variable)
from headrace.daemon.routes.tokenizer_api import detokenize, tokenize
from headrace.daemon.routes.workflow_api import (cancel_run, create_run, get_run, get_timeline, get_timeline_png,
                                                 list_runs, list_workflows, run_events, run_graph)

API_ROUTES = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/v1/models", list_models),
    # :path, so an id with '/' (an org/model name) is answered "model not found", not "no route"
    Route("/v1/models/{model:path}", get_model),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/rerank", rerank, methods=["POST"]),
    Route("/v1/collections", list_collections),
    Route("/v1/collections", create_collection, methods=["POST"]),
    Route("/v1/collections/{collection}", get_collection),
    Route("/v1/collections/{collection}", delete_collection, methods=["DELETE"]),
    Route("/v1/collections/{collection}/documents", add_documents, methods=["POST"]),
    # :path, because an id may hold '/' (headrace ingest names documents by relative path)
    Route("/v1/collections/{collection}/documents/{document_id:path}", delete_document, methods=["DELETE"]),
    Route("/v1/engines/{engine}", update_engine, methods=["PATCH"]),
    Route("/v1/sessions", create_session, methods=["POST"]),
    Route("/v1/sessions/{session_id}", get_session),
    Route("/v1/sessions/{session_id}", delete_session, methods=["DELETE"]),
    Route("/v1/sessions/{session_id}/variables", create_variable, methods=["POST"]),
    Route("/v1/sessions/{session_id}/variables/{variable}", get_variable),
    Route("/v1/sessions/{session_id}/variables/{variable}", set_variable, methods=["PUT"]),
    Route("/v1/sessions/{session_id}/calls", create_call, methods=["POST"]),
    Route("/v1/workflows", list_workflows),
    Route("/v1/workflows/{name}/runs", create_run, methods=["POST"]),
    Route("/v1/runs", list_runs),
    Route("/v1/runs/{run_id}", get_run),
    Route("/v1/runs/{run_id}", cancel_run, methods=["DELETE"]),
    Route("/v1/runs/{run_id}/events", run_events),
    Route("/v1/runs/{run_id}/graph", run_graph),
    Route("/v1/runs/{run_id}/timeline", get_timeline),
    Route("/v1/runs/{run_id}/timeline.png", get_timeline_png),
]
