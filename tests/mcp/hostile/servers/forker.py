"""Starts a detached grandchild in a session of its own, then exits."""
import os
import subprocess

from mcp.server.mcpserver import MCPServer

server = MCPServer("forker")


@server.tool()
def fork() -> str:
    """Leaves a grandchild behind and exits mid-call."""
    child = subprocess.Popen(
        ["sleep", "1000"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with open("grandchild.pid", "w") as f:
        f.write(str(child.pid))
    os._exit(0)


server.run("stdio")
