# frozen_string_literal: true

require 'io/wait'
require 'json'
require 'socket'

module PuppetX
  # Talking to vmhostd: the socket path, the errors and the JSON-RPC client.
  module Vmhost
    # The daemon's default socket, as in vmhostd's config and vmhostctl.
    DEFAULT_SOCKET = '/run/vmhost/vmhostd.sock'
    # The environment variable vmhostctl reads too.
    SOCKET_ENV = 'VMHOST_SOCKET'

    # The socket to use: an explicit path, else $VMHOST_SOCKET, else the default.
    def self.socket_path(explicit = nil)
      return explicit.to_s unless explicit.nil? || explicit.to_s.empty?

      env = ENV.fetch(SOCKET_ENV, '')
      env.empty? ? DEFAULT_SOCKET : env
    end

    # Any failure talking to vmhostd.
    class Error < StandardError; end

    # The socket could not be reached, or the connection broke before a reply.
    class ConnectionError < Error; end

    # No reply within the timeout.
    class TimeoutError < Error; end

    # The reply does not follow the protocol (not JSON, too long, wrong id, ...).
    class ProtocolError < Error; end

    # The daemon answered with a JSON-RPC error object.
    class DaemonError < Error
      attr_reader :code, :kind, :field, :details, :daemon_message, :rpc_method

      def initialize(rpc_method, error)
        error = {} unless error.is_a?(Hash)
        data = error['data'].is_a?(Hash) ? error['data'] : {}
        @rpc_method = rpc_method
        @code = error['code']
        @daemon_message = error['message'].to_s
        @kind = data['kind']
        @field = data['field']
        @details = data['details']
        super(build_message)
      end

      private

      def build_message
        text = +"vmhostd refused #{@rpc_method}: error #{@code}"
        text << " (#{@kind})" if @kind
        text << " on field #{@field}" if @field
        text << ": #{@daemon_message}"
        text << "; details: #{JSON.generate(@details)}" unless @details.nil?
        text
      end
    end

    # A JSON-RPC 2.0 client for vmhostd: one request per connection, one JSON line each way.
    # Standard library only. Every wait is bounded: connect, write and read share a deadline,
    # and a reply line longer than max_reply_bytes is refused.
    class Client
      # Read calls are quick; mutating ones can wait for a guest shutdown (30 s) plus QEMU start.
      DEFAULT_TIMEOUT = 30
      MUTATING_TIMEOUT = 300
      # vmhostd's default for image.import's timeout_s (the longest a download may take): an
      # import waits that long on top of MUTATING_TIMEOUT when no timeout_s is given.
      DEFAULT_IMPORT_TIMEOUT_S = 3600
      CONNECT_TIMEOUT = 5
      # vm.list of many VMs is the largest reply; 16 MiB leaves room for thousands.
      MAX_REPLY_BYTES = 16 * 1024 * 1024
      READ_CHUNK = 65_536

      attr_reader :path, :timeout

      def initialize(path = nil, timeout: DEFAULT_TIMEOUT, connect_timeout: CONNECT_TIMEOUT,
                     max_reply_bytes: MAX_REPLY_BYTES)
        @path = Vmhost.socket_path(path)
        @timeout = Float(timeout)
        @connect_timeout = Float(connect_timeout)
        @max_reply_bytes = Integer(max_reply_bytes)
        @counter = 0
      end

      # Calls METHOD with PARAMS (a Hash) and returns the result, or raises a Vmhost::Error.
      def call(method, params = {}, timeout: nil)
        deadline = monotonic + (timeout.nil? ? @timeout : Float(timeout))
        id = next_id
        line = JSON.generate({ 'jsonrpc' => '2.0', 'id' => id, 'method' => method, 'params' => params })
        sock = connect(deadline)
        begin
          write_all(sock, "#{line}\n", deadline, method)
          reply = read_line(sock, deadline, method)
        ensure
          sock.close
        end
        decode(reply, id, method)
      end

      private

      def monotonic
        Process.clock_gettime(Process::CLOCK_MONOTONIC)
      end

      def next_id
        @counter += 1
        "puppet-#{Process.pid}-#{@counter}"
      end

      def remaining(deadline)
        deadline - monotonic
      end

      def connect(deadline)
        sock = Socket.new(:UNIX, :STREAM)
        begin
          sock.connect_nonblock(Socket.sockaddr_un(@path))
        rescue IO::WaitWritable
          wait = [remaining(deadline), @connect_timeout].min
          unless wait.positive? && sock.wait_writable(wait)
            sock.close
            raise TimeoutError, "connecting to vmhostd at #{@path} timed out"
          end
          begin
            sock.connect_nonblock(Socket.sockaddr_un(@path))
          rescue Errno::EISCONN
            nil
          end
        end
        sock
      rescue SystemCallError, ArgumentError => e
        sock&.close
        raise ConnectionError, "cannot connect to vmhostd at #{@path}: #{e.message}"
      end

      def write_all(sock, data, deadline, method)
        until data.empty?
          n = sock.write_nonblock(data, exception: false)
          if n == :wait_writable
            left = remaining(deadline)
            unless left.positive? && sock.wait_writable(left)
              raise TimeoutError,
                    "#{method}: vmhostd at #{@path} did not accept the request in time"
            end

            next
          end
          data = data.byteslice(n..)
        end
      rescue SystemCallError, IOError => e
        raise ConnectionError, "#{method}: sending to vmhostd at #{@path} failed: #{e.message}"
      end

      # Reads the first non-blank line. Bytes after it are ignored (one request per connection).
      def read_line(sock, deadline, method)
        buf = +''
        buf.force_encoding(Encoding::BINARY)
        loop do
          if (nl = buf.index("\n"))
            line = buf.byteslice(0, nl)
            return line unless line.strip.empty?

            buf = buf.byteslice((nl + 1)..)
            next
          end
          check_length(buf, method)
          chunk = sock.read_nonblock(READ_CHUNK, exception: false)
          case chunk
          when :wait_readable
            left = remaining(deadline)
            unless left.positive? && sock.wait_readable(left)
              raise TimeoutError, "#{method}: no reply from vmhostd at #{@path} within #{@timeout.round}s"
            end
          when nil
            raise ConnectionError, "#{method}: vmhostd at #{@path} closed the connection without a reply"
          else
            buf << chunk
          end
        end
      rescue SystemCallError, IOError => e
        raise ConnectionError, "#{method}: reading from vmhostd at #{@path} failed: #{e.message}"
      end

      def check_length(buf, method)
        return if buf.bytesize <= @max_reply_bytes

        raise ProtocolError, "#{method}: reply from vmhostd longer than #{@max_reply_bytes} bytes"
      end

      def decode(line, id, method)
        line = line.dup.force_encoding(Encoding::UTF_8)
        raise ProtocolError, "#{method}: reply from vmhostd is not valid UTF-8" unless line.valid_encoding?

        msg = begin
          JSON.parse(line)
        rescue JSON::ParserError => e
          raise ProtocolError, "#{method}: reply from vmhostd is not JSON: #{e.message[0, 200]}"
        end
        raise ProtocolError, "#{method}: reply from vmhostd is not a JSON object" unless msg.is_a?(Hash)

        # An error with id null answers the connection (unauthorized peer) or a request the
        # daemon could not read; it is the daemon's answer to us either way.
        raise DaemonError.new(method, msg['error']) if msg['error'] && msg['id'].nil?

        unless msg['id'] == id
          raise ProtocolError,
                "#{method}: reply id #{msg['id'].inspect} does not match request id #{id.inspect}"
        end
        raise DaemonError.new(method, msg['error']) if msg.key?('error')
        raise ProtocolError, "#{method}: reply from vmhostd has neither result nor error" unless msg.key?('result')

        msg['result']
      end
    end
  end
end
