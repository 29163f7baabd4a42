"""A local repository rule that makes Bazel's Python toolchain use one explicit interpreter.

The interpreter is, first match wins: the KDA_PYTHON environment variable (the setup script
sets it to the python3 it installed the project's packages into, through --repo_env), else
python3 on the client's PATH. The rule resolves it to the real executable (sys.executable, so
pyenv shims are followed) and registers a py_runtime for PY3 with it. Nothing is downloaded.
"""

def _kda_python_impl(rctx):
    candidate = rctx.os.environ.get("KDA_PYTHON", "") or "python3"
    if "/" not in candidate:
        found = rctx.which(candidate)
        if found == None:
            fail("kda_python: no %s on PATH; set KDA_PYTHON to the interpreter to use" % candidate)
        candidate = str(found)
    res = rctx.execute([candidate, "-c", "import sys; print(sys.executable)"])
    if res.return_code != 0:
        fail("kda_python: %s failed: %s" % (candidate, res.stderr))
    exe = res.stdout.strip()
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    rctx.file("BUILD", """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

# The interpreter the project's packages were installed into: {exe}
py_runtime(
    name = "py3_runtime",
    interpreter_path = "{exe}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(exe = exe))

kda_python = repository_rule(
    implementation = _kda_python_impl,
    environ = ["KDA_PYTHON", "PATH"],
    local = True,
)
