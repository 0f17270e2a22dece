# labkit for a workshop room: JupyterLab with the lab's notebooks, on NVIDIA's CUDA runtime image.
#
#   docker build -t labkit .
#   docker run --rm --gpus all -p 127.0.0.1:8888:8888 \
#       -e JUPYTER_TOKEN="$(openssl rand -hex 24)" -e LABKIT_PARTICIPANT=ana -e LABKIT_TEAM=red \
#       -v /shared/labkit-runs:/runs labkit
#
# --gpus needs the NVIDIA Container Toolkit on the host. Inside the container JupyterLab binds to
# 0.0.0.0 (the only way in through Docker's port mapping) and always asks for a token; publish the
# port on 127.0.0.1 as above and reach it through an SSH tunnel or a hub, never on an open address.
# The package set is pyproject.toml's: torch first from PyTorch's CUDA index (the same `torch>=2.6`
# requirement), then `pip install -e .` (tests/test_workshop.py checks that nothing else is added).
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip \
    && rm -rf /var/lib/apt/lists/*

# The CUDA 12.4 build of torch (matching the base image); `pip install -e .` then finds it.
RUN pip3 install --index-url https://download.pytorch.org/whl/cu124 "torch>=2.6"

# Editable, so labkit finds its notebooks/ and data/ beside the package (hardware.REPO_DIR).
WORKDIR /opt/labkit
COPY pyproject.toml README.md ./
COPY labkit ./labkit
COPY notebooks ./notebooks
COPY data ./data
RUN pip3 install -e .

# A user of its own; /runs is the results store (mount the room's shared folder there).
RUN useradd --create-home --uid 1000 lab && mkdir /runs && chown -R lab /runs /opt/labkit/notebooks
USER lab
ENV LABKIT_RUNS_DIR=/runs
EXPOSE 8888

# The token comes from JUPYTER_TOKEN; unset, Jupyter makes a random one and prints it in the log.
CMD ["python3", "-m", "jupyterlab", "--ip=0.0.0.0", "--port=8888", "--no-browser", \
     "--ServerApp.root_dir=/opt/labkit/notebooks"]
