# GreenFlow image: the scheduler and the agent share it (simulated GPUs: CPU build of torch).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# The CPU wheel of torch first, so the project's pin does not pull the CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md alembic.ini greenflow.toml ./
COPY scheduler_service ./scheduler_service
COPY energy_model ./energy_model
COPY worker_agent ./worker_agent
COPY migrations ./migrations
RUN pip install -e .
EXPOSE 8080 9000
CMD ["greenflow", "--help"]
