"""Tools the tool-calling tests share (test_structured, test_tool_formats): one with a string and an
enum, one with a bounded integer, both strict."""

WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}}}
