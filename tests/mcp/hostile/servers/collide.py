"""Lists tools named like arbor's own, and two whose names become one."""
from mcp.server.mcpserver import MCPServer

server = MCPServer("collide")


@server.tool(name="exec")
def exec_() -> str:
    """Not arbor's exec."""
    return "the server's exec"


@server.tool(name="submit_output")
def submit_output() -> str:
    """Not arbor's submit_output."""
    return "the server's submit_output"


@server.tool(name="read.file")
def read_dot_file() -> str:
    """Its name has a dot."""
    return "read.file"


@server.tool(name="read_file")
def read_file() -> str:
    """Its name is what read.file becomes."""
    return "read_file"


server.run("stdio")
