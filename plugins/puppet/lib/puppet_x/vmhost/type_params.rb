# frozen_string_literal: true

module PuppetX
  module Vmhost
    # Parameters every vmhost type (vmhost_vm, vmhost_image) declares alike. Each adds the
    # parameter to `type` (the type being defined: `self` in Puppet::Type.newtype's block).
    module TypeParams
      # The namevar, described by `text`: any non-empty string (its form is vmhostd's to check).
      def self.name_param(type, text)
        type.newparam(:name, namevar: true) do
          desc text

          validate do |value|
            raise ArgumentError, 'name must be a non-empty string' unless value.is_a?(String) && !value.empty?
          end
        end
      end

      # vmhostd's API socket, an absolute path (the providers fall back on PuppetX::Vmhost.socket_path).
      def self.socket_param(type)
        type.newparam(:socket) do
          desc <<~DOC
            vmhostd's API socket. Default: the environment variable `VMHOST_SOCKET` (as for
            vmhostctl) when it is set and not empty, else `/run/vmhost/vmhostd.sock`.
          DOC

          validate do |value|
            raise ArgumentError, 'socket must be an absolute path' unless value.is_a?(String) && value.start_with?('/')
          end
        end
      end
    end
  end
end
