"""The controller's gRPC servicers by role: the agent stream (agent_service.py), FarmService's job,
artifact, question and operator calls (jobs.py, artifacts.py, questions.py, admin.py, composed in farm_service.py),
and what they call (farm_server.py). controller/grpc_server.py serves them."""
