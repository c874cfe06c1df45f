"""Builds the optional native JPEG kernel (loader_service/decode/_jpegroi.c) and the lossless JPEG
preparation tool (loader_service/decode/_jpegprep.c: `loader-service prepare-jpegs`) against the
system libjpeg-turbo; everything else is in pyproject.toml.

The build is optional: without libjpeg-turbo's headers (Debian: libjpeg62-turbo-dev) the
install still succeeds and the service decodes through simplejpeg (no fused crop). Set
LOADER_REQUIRE_NATIVE_JPEG=1 to make a failed build an install error (CI and the image do).
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REQUIRE = os.environ.get("LOADER_REQUIRE_NATIVE_JPEG", "").strip() not in ("", "0")


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler or no headers: keep the pure-Python decode path
            if REQUIRE:
                raise
            print(f"WARNING: the native JPEG kernel was not built ({exc}); decoding falls back to simplejpeg")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            if REQUIRE:
                raise
            fallback = ("decoding falls back to simplejpeg" if ext.name.endswith("_jpegroi")
                        else "`loader-service prepare-jpegs` is unavailable")
            print(f"WARNING: {ext.name} was not built ({exc}); {fallback}")


setup(
    ext_modules=[Extension(name, [f"loader_service/decode/{name.split('.')[-1]}.c"], libraries=["jpeg"],
                           extra_compile_args=["-O2", "-std=c99"], depends=["loader_service/decode/_jpegshared.h"],
                           optional=not REQUIRE)
                 for name in ("loader_service.decode._jpegroi", "loader_service.decode._jpegprep")],
    cmdclass={"build_ext": OptionalBuildExt},
)
