"""kda_pytest: a native py_test that runs pytest on its sources with the project's interpreter."""

def kda_pytest(name, srcs, deps = [], data = [], env = {}, args = [], size = "medium", tags = [], **kwargs):
    """Runs `pytest <srcs>` as one Bazel test target.

    Args:
      name: target name (never name it like a tool on PATH, e.g. not `nvcc`).
      srcs: the test_*.py files of this package.
      deps: py_library deps (//kda is always added).
      data: extra runtime files.
      env: environment for the test (e.g. TRITON_INTERPRET, CUTE_DSL_ARCH).
      args: extra pytest arguments.
      size, tags, kwargs: as for py_test.
    """
    pkg = native.package_name()
    native.py_test(
        name = name,
        srcs = srcs + ["//tests:pytest_main.py"] + native.glob(["__init__.py"]),
        main = "//tests:pytest_main.py",
        deps = depset(deps + ["//kda", "//tests:conftest"]).to_list(),
        data = data,
        env = env,
        args = ["%s/%s" % (pkg, s) for s in srcs] + args,
        size = size,
        tags = tags,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )
