#!/bin/sh
# Install what the native JPEG kernel (loader_service/decode/_jpegroi.c) and its tests need on a fresh
# Debian machine, from Debian's archive. Idempotent.
#   gcc, libc6-dev            build the extension
#   libjpeg62-turbo-dev       libjpeg-turbo's headers and library
#   libjpeg-turbo-progs       jpegtran: the tests make an arithmetic-coded JPEG with it
set -eu
need=""
command -v gcc >/dev/null 2>&1 || need="$need gcc libc6-dev"
[ -f /usr/include/jpeglib.h ] || need="$need libjpeg62-turbo-dev"
command -v jpegtran >/dev/null 2>&1 || need="$need libjpeg-turbo-progs"
if [ -z "$need" ]; then
    echo "native JPEG prerequisites already installed"
    exit 0
fi
echo "installing:$need"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null
